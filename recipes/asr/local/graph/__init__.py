"""Lang and graph: lexicon and L.fst, the n-gram LM and G.fst (stage 2), HCLG and the training-graph
compiler, and the lattice decoder with Kaldi-style scoring used by every system."""
