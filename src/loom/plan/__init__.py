"""`loom plan`: per-GPU memory, communication and step-time estimates for parallel layouts (layer 5).

shapes.py   presets, a config's [model] section, or a bare parameter count
memory.py   model states (ZeRO paper) and activations tensor by tensor as loom's block keeps them
peak.py     what a rank holds at each moment a step can peak (activations, FSDP's buffers), stage by stage
estimate.py enumeration of (dp, tp, pp, ZeRO, micro-batch, recompute), communication and time model
report.py   reasons, table, JSON and the command line

Pure arithmetic: nothing here imports torch.
"""

from loom.plan.estimate import Candidate, Cluster, Workload, plan
from loom.plan.memory import PRECISIONS, model_state_bytes
from loom.plan.report import plan_main
from loom.plan.shapes import PRESETS, ModelShape, resolve_model

__all__ = [
    "PRESETS",
    "PRECISIONS",
    "Candidate",
    "Cluster",
    "ModelShape",
    "Workload",
    "model_state_bytes",
    "plan",
    "plan_main",
    "resolve_model",
]
