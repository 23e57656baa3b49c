"""Model: architecture presets, layers, the transformer and its KV cache, layer layouts."""
