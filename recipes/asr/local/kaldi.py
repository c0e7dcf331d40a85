"""The one place that imports the Kaldi Python bindings, in the order that works.

``kaldi_hmm_gmm`` must be imported before ``kaldifst`` and ``kaldilm``: importing kaldilm
1.15.5 first and kaldi_hmm_gmm afterwards hangs the process (seen with kaldifst 1.7.17).
Every recipe module takes ``khg`` and ``kaldifst`` from here.
"""

# isort: off  (kaldi_hmm_gmm first: see above)
import kaldi_hmm_gmm as khg
import kaldifst

# isort: on

__all__ = ["kaldifst", "khg"]
