"""The model: a decoder-only transformer of the Llama-3.x / Qwen-3 family in Flax NNX.

architectures  `ModelConfig` and its presets (Llama-3.1 8B, Qwen-3 8B, the paper's 3B, tiny)
layers         parameters with logical axes, RMSNorm, RoPE, SwiGLU, the embedding
kv_cache       the decode's KV cache and one layer's view of it
transformer    attention, blocks, the transformer (unrolled or scanned, with remat)
layer_layout   unrolled and stacked layer parameters, and conversion between them
"""
