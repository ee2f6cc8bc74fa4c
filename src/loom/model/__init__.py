"""The single-device GPT (never imports torch.distributed or loom.parallel)."""

from loom.model import families  # noqa: F401  (registers the built-in families, gpt2 and llama)
from loom.model.gpt import GPT, GPTConfig, KVCache

__all__ = ["GPT", "GPTConfig", "KVCache"]
