"""torch.compile per transformer block, in place (`nn.Module.compile`), as torchtitan does.

Compiling the blocks rather than the whole model is what makes compile compose with the rest: pipeline
stages run the very blocks that were compiled (compiling the model would compile a module the schedule never
calls), FSDP wraps compiled blocks, and parameter names do not change. The identical blocks share one graph.
"""

from __future__ import annotations

import torch.nn as nn


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block's forward in place; applied after activation checkpointing, before FSDP/DDP."""
    for block in blocks:
        block.compile()
