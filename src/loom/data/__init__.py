"""Data: text -> tokenizer -> token shards -> loader."""
