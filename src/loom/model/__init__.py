"""The single-device GPT (never imports torch.distributed or loom.parallel)."""

from loom.model.gpt import GPT, GPTConfig, KVCache

__all__ = ["GPT", "GPTConfig", "KVCache"]
