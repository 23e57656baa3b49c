"""Hugging Face interop: the config map, one declarative parameter table, import and export.

Needs the `hf` extra (safetensors); `transformers` itself is only used by tests.
"""
