"""Quantized weights for inference (`loom generate`, `loom serve`, `loom bench generate` --quantize int8).

int8 weight-only through torchao (`quantize_(model, Int8WeightOnlyConfig())`): every nn.Linear weight becomes
int8 values with one scale per output channel; activations stay in the model's dtype, and the product
dequantizes on the fly (a CPU runs torch's int8-weight matmul; a GPU torchao's fused kernels). A decode step reads
the weights once per token, so a quarter of fp32's bytes (a half of bf16's) is what it saves; the embedding and
the norms stay as they are. The figures (tokens/s, the val-loss change) are in
benchmarks/results/cpu-2core-2026-12-02/serving2.md; the GPU kit's `int8-decode` line measures it against bf16.
"""

from __future__ import annotations

import torch.nn as nn

from loom.errors import LoomError

QUANTIZE = ("int8",)  # what --quantize takes
_HINT = "install torchao: pip install -e '.[fp8]' (the fp8 extra carries it)"


def check_quantize(how: str | None) -> None:
    """A --quantize value loom cannot apply: LoomError before anything loads."""
    if how is None:
        return
    if how not in QUANTIZE:
        raise LoomError(f"--quantize takes {', '.join(QUANTIZE)}, got '{how}'")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise LoomError(f"--quantize {how} needs torchao", hint=_HINT) from None


def quantize_weights(model: nn.Module, how: str | None) -> int:
    """The model's nn.Linear weights quantized in place (`how`: int8, weight-only; None: nothing). Returns how
    many layers were quantized. For a model that only runs forwards: torchao's int8 tensors take no gradient
    step."""
    if how is None:
        return 0
    check_quantize(how)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    n = sum(isinstance(m, nn.Linear) for m in model.modules())
    quantize_(model, Int8WeightOnlyConfig())
    return n
