"""Data: tokenizer training, raw text -> memory-mapped token shards, and the deterministic batch loader."""
