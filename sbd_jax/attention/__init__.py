"""Mask-aware attention: token metadata, the dense reference, chunked and splash kernels."""
