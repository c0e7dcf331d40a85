"""Recipe stages of the hybrid DNN-HMM ASR recipe, one small module per job, grouped by what they serve:

- ``data/``: corpus (synthetic TTS or a local real corpus) to Lhotse manifests, features, other test sets;
- ``graph/``: lang, LM, HCLG, the decoder and scoring;
- ``gmm/``: monophone, triphone (tree), SAT (fMLLR) systems and the DNN's alignments;
- ``dnn/``: the speaker-adapted fbank front end, the frame data module, the DNN, run comparison.

Shared by all: ``kaldi`` (the bindings, imported in the order that works), ``atomic`` (interrupt-safe
writes), ``drops`` (skipped utterances with reasons), ``wer_stats`` (bootstrap intervals) and
``report`` (the data pipeline's summary).
"""
