"""Recipe stages of the hybrid DNN-HMM ASR recipe, one small module per job."""
