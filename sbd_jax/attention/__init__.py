"""Mask-aware attention: who sees whom is a function of per-token metadata, never a mask.

meta      `TokenMeta` and `visibility`, the rule every kernel follows
dense     the reference with an explicit mask (what the kernels are tested against)
chunked   flash-style attention with a custom VJP, for training and decoding on any device
splash    Pallas splash kernels (TPU) for the training layouts
block_local the SBD row's near-diagonal part as a small dense op, merged by log-sum-exp
dispatch  `attend(..., impl=...)`
"""
