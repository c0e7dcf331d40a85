"""Corpus and data: the embedded TTS corpus (or a local real corpus) to Lhotse manifests, features and
CMVN statistics (stages 0-1), and the reading of other test sets for ``evaluate.py``."""
