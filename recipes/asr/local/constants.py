"""Settings shared by several stages of the recipe, defined once here.

The acoustic-scale grids are where the dev sweeps start (``local.graph.decode.pick_scale`` extends a
grid whose best dev scale lies at an edge). An acoustic scale is 1 / LM weight; Kaldi's scoring sweeps
LM weights 7 .. 17 on lattices made at acoustic scale 0.1.
"""

SPLITS = ("train", "dev", "test")

# Kaldi's --transition-scale and --self-loop-scale, of the training graphs and of HCLG alike
TRANSITION_SCALE = 1.0
SELF_LOOP_SCALE = 0.1

# LM weights 20, 17, 15, 12. Until corpus version 3 the grid began at 0.0667, and every GMM system picked
# that edge on dev. On the default corpus's dev set the speaker-independent systems then picked 0.0588-0.0667
# from 0.05 .. 0.125 (monophone 14.68 % at 0.0667, 15.96 % at 0.1, 18.18 % at 0.125; triphone and LDA+MLLT
# alike), so the grid stops at 0.0833; a best scale at either edge extends it (``pick_scale``).
GMM_ACOUSTIC_SCALES = (0.05, 0.0588, 0.0667, 0.0833)
# The SAT system's fMLLR decoding (its final pass at each scale): on corpus version 3's dev it picked 0.05 (Δ + ΔΔ features) and
# 0.0425 (LDA+MLLT; 7.36 % at 0.0361, 8.07 % at 0.0667, 10.56 % at 0.1), so its grid is one step lower.
SAT_ACOUSTIC_SCALES = (0.0425, 0.05, 0.0588, 0.0667)
# LM weights 10 .. 4, the middle of Kaldi's range. Smaller scales decode slower (flatter scores fill the
# beam); at beam 10 with 3000 active states the decoder's work per frame is bounded. Until corpus version 3
# the grid was LM weights 8 .. 3, and dev preferred its lowest scale, 0.125: an optimum at the edge.
DNN_ACOUSTIC_SCALES = (0.1, 0.111, 0.125, 0.143, 0.167, 0.2, 0.25)
# The scale dev's ties go to, and the one test is decoded at when a corpus has no dev set: Kaldi's decoding
# scales, steps/decode.sh's --acwt 0.083333 (LM weight 12) for the GMM systems and the nnet recipes' 0.1 for
# the DNN.
GMM_PREFERRED_SCALE = 0.0833
DNN_PREFERRED_SCALE = 0.1
# Word insertion penalties tried on dev (Kaldi's score.sh: 0.0 0.5 1.0): by rescoring the DNN's lattices, and by
# decoding the GMM systems again at dev's scale, in order while each is better (``pick_penalty``). A best penalty
# at an edge extends the grid by a step (``penalty_past_edge``): both ways on the lattices, where a point costs a
# best path; upwards only for the GMM systems, whose lower bound 0 is fixed in advance (a negative penalty would
# cost each system a decoding of dev more in the main job, and Kaldi's scoring never tries one).
WORD_INSERTION_PENALTIES = (0.0, 0.5, 1.0)
# Most steps a grid is extended by when dev's best scale stays at its edge (``pick_scale``).
MAX_GRID_EXTENSIONS = 3
