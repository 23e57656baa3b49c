"""Data: the built-in arithmetic task, tokenizers and chat templates, Grain sources, packing.

arithmetic   GSM8K-shaped word problems, generated per (split, index, seed); held out by hash
tokenizer, vocab, chat   byte / word / Hugging Face tokenizers; chat templates and their masks
sources, pipeline        JSONL / text / ArrayRecord / TFDS records into packed [B, L] rows
to_array_record          CLI: a JSONL corpus into ArrayRecord shards
"""
