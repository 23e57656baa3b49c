"""Decoding: sampler settings, the on-device loop and queue, the host-side sampler."""
