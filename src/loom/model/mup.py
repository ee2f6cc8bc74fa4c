"""μP, the Maximal Update Parametrisation (model.mup, model.mup_base_width): hyperparameters tuned at a small
base width hold at a larger one.

The variant: Tensor Programs V (Yang, Hu, Babuschkin, Sidor, Liu, Farhi, Ryder, Pachocki, Chen, Gao 2022,
"Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer", Table 3, the Adam column), written as
EleutherAI's "The Practitioner's Guide to the Maximal Update Parameterization" (Dey, Anthony, Hestness 2024) and
its nanoGPT-mup implement it: the output weights keep their init and take an output multiplier 1/m instead of
Table 3's 1/fan_in init (the equivalent form of Table 8). With m = n_embd / mup_base_width:

| parameter kind                         | init std        | AdamW learning rate | forward                 |
|----------------------------------------|-----------------|---------------------|-------------------------|
| embedding (wte, wpe)                   | sigma           | eta                 | unchanged               |
| hidden matrix (q, k, v, o, MLP)        | sigma / sqrt(m) | eta / m             | unchanged               |
| output head (lm_head, tied or not)     | sigma           | eta                 | logits * 1/m            |
| vector (biases, norm gains)            | unchanged       | eta                 | unchanged               |
| attention logits                       |                 |                     | q.k * sqrt(D_base) / D  |

sigma and eta are the base width's (GPT-2's 0.02, depth-scaled for residual outputs; optim.lr). The attention
scale is 1/D with the guide's attn_mult = sqrt(D_base), D_base = mup_base_width / n_head, so that at the base
width every row equals the standard parametrisation: μP changes nothing there, and a learning rate tuned on SP
at the base width is the μP one.

Muon (optim.name=muon): its hidden matrices step along an orthogonalised update scaled by sqrt(max(1,
fan_out / fan_in)) (loom.optim.muon), whose spectral norm already does not grow with width: that is the
spectral condition for feature learning (Yang, Simon, Bernstein 2023, "A Spectral Condition for Feature
Learning"), μP for Muon. So under μP Muon's matrices keep optim.muon_lr (multiplier 1) and get the hidden init
above; the parameters Muon leaves to AdamW (embeddings, head, vectors) follow the table's AdamW column. Weight
decay is decoupled (torch's AdamW: lr * weight_decay per step), so it follows each group's learning rate.
"""

from __future__ import annotations

import math

import torch

EMBEDDINGS = ("wte.weight", "wpe.weight")
OUTPUT = ("lm_head.weight",)
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "module.")


def param_kind(name: str, p: torch.Tensor) -> str:
    """'embedding' | 'hidden' | 'output' | 'vector' of a GPT parameter by its (possibly wrapped) name."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    if name.endswith(EMBEDDINGS):
        return "embedding"
    if name.endswith(OUTPUT):
        return "output"
    return "vector" if p.dim() < 2 else "hidden"


# the table's multipliers of the base width's init std and AdamW learning rate, per kind, as functions of m
INIT_MULT = {"embedding": lambda m: 1.0, "hidden": lambda m: 1 / math.sqrt(m), "output": lambda m: 1.0}
LR_MULT = {"embedding": lambda m: 1.0, "hidden": lambda m: 1 / m, "output": lambda m: 1.0}


def mup_init_mult(name: str, cfg) -> float:
    """The init std's multiplier of the single-device parameter `name` (1.0 without μP)."""
    m = cfg.mup_width_mult
    if m == 1.0:
        return 1.0
    kind = "hidden" if not name.endswith(EMBEDDINGS + OUTPUT) else param_kind(name, torch.empty(0, 0))
    return INIT_MULT[kind](m)


def mup_attention_mult(cfg) -> float:
    """What q is multiplied by so that softmax(q.k / sqrt(D)) becomes μP's softmax(q.k sqrt(D_base) / D)."""
    if not cfg.mup_base_width:
        return 1.0
    base_head = cfg.mup_base_width / cfg.n_head  # the heads' count stays, their width grows with n_embd
    return math.sqrt(base_head / cfg.head_dim)


def lr_multipliers(model: torch.nn.Module) -> dict[int, float]:
    """{id(parameter): AdamW learning-rate multiplier} of a μP model's parameters; {} without μP (or for a
    model that is not loom's GPT). Muon's hidden matrices take it too, but loom.optim.build ignores it there
    (see the module docstring)."""
    cfg = getattr(model, "cfg", None)
    m = getattr(cfg, "mup_width_mult", 1.0)
    if m == 1.0:
        return {}
    out = {}
    for name, p in model.named_parameters():
        kind = param_kind(name, p)
        out[id(p)] = LR_MULT[kind](m) if kind in LR_MULT else 1.0
    return out
