"""The paper's method, Set Block Decoding.

masks           token metadata of the SBD layouts; `sbd_training_mask` is the paper's Figure 8
noising         the 2L training input [x ; x̂] and the targets of both terms
objective       the NTP + MATP loss (`ObjectiveConfig`, `loss_fn`)
cross_entropy   per-token cross-entropy, whole or in chunks
reveal_rules    which masked positions a forward reveals (EB entropy / confidence, Factor)
"""
