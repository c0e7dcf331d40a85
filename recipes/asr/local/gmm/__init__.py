"""GMM systems: monophone, triphone on a phonetic decision tree, speaker-adaptive (SAT, fMLLR), their
decoding, and the fMLLR alignments that become the DNN's targets (stages 3-6)."""
