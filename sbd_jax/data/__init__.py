"""Data: tokenizers, the built-in arithmetic task, sources and the packed Grain pipeline."""
