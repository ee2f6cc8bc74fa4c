"""Model families, one folder each (gpt/: gpt2 and llama; moe/), and what they share: the registry, the HF
front door and I/O, LoRA, document masks, the CPU fast paths, FLOPs. The models never import torch.distributed
or loom.parallel (only a family's *_parallel.py names torch's parallel styles)."""

from loom.model.gpt import family as _gpt  # noqa: F401  (registers gpt2 and llama)
from loom.model.gpt.gpt import GPT, GPTConfig, KVCache
from loom.model.moe import family as _moe  # noqa: F401  (registers moe)

__all__ = ["GPT", "GPTConfig", "KVCache"]
