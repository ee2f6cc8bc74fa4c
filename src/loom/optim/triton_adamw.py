"""AdamW whose whole update, every parameter of every group, is one Triton kernel launch per step.

A multi-tensor kernel in the style of apex's `multi_tensor_apply`, with a table instead of chunked
argument lists: each step builds one row per parameter that has a gradient,

    row (ROW int64 words): param, grad, exp_avg, exp_avg_sq addresses | numel | first block |
                           8 fp32 hyper-parameters (weight-decay factor, 1-beta1, beta2, 1-beta2,
                           sqrt(bias correction 2), eps, -lr / bias correction 1, gradient sign)

copied to the device in one transfer, and a cached block table maps each Triton program to its row.
So parameters keep their own storage (nothing is flattened or re-pointed, DDP and checkpoints see
ordinary tensors), groups with different hyper-parameters and parameters at different step counts
(after loading a checkpoint) share the one launch.

Numerics follow torch.optim.AdamW's single-tensor path operation by operation, in fp32, with IEEE
division and square root and no FMA contraction: `param *= 1 - lr*wd; exp_avg.lerp_(grad, 1-beta1);
exp_avg_sq = exp_avg_sq*beta2 + (1-beta2)*grad*grad; param += -step_size * exp_avg /
(sqrt(exp_avg_sq) / sqrt(bc2) + eps)`. The state (`step` as a CPU fp32 tensor, `exp_avg`,
`exp_avg_sq`) and the param-group keys are torch's, so a `state_dict()` from either optimizer loads
into the other.

Runs natively on CUDA (and ROCm) devices. On CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1` in the environment before the first step): correct but slow, for tests.
Triton is imported only when an optimizer is built; `import loom.optim.triton_adamw` needs no triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from loom import compat
from loom import device as dev
from loom.errors import LoomError

BLOCK = 1024  # elements per Triton program; a multiple of 4 keeps full blocks 16-byte aligned
ROW = 10  # int64 words per parameter row: 4 addresses, numel, first block, 8 fp32 (4 words)
NUM_WARPS = 4
_KERNELS: dict[bool, Any] = {}  # interpreter mode → the jitted kernel


def _triton():
    """The triton module, or a LoomError that names the extra to install."""
    try:
        import triton
    except ImportError as e:
        raise LoomError(
            "optim.impl=triton needs the triton package, which is not installed",
            hint="pip install 'loom[triton]'",
        ) from e
    return triton


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    triton = _triton()
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(device: torch.device) -> None:
    """Raise a LoomError unless TritonAdamW can run on `device` in this process."""
    interpret = interpreter_enabled()
    if device.type == "cuda":
        if interpret:
            raise LoomError(
                "TRITON_INTERPRET=1 runs kernels on the CPU and cannot follow TritonAdamW's table of "
                "addresses into CUDA memory",
                hint="unset TRITON_INTERPRET to run the kernel natively on the GPU",
            )
        return
    if device.type == "cpu":
        if not interpret:
            raise LoomError(
                "optim.impl=triton runs on CUDA GPUs; on a CPU Triton has no driver",
                hint="use optim.impl=torch-fused on CPU (TRITON_INTERPRET=1 runs the kernel in Triton's "
                "interpreter: correct but far too slow for training, for tests only)",
            )
        return
    raise LoomError(f"optim.impl=triton does not run on {device.type} devices", hint="use optim.impl=auto")


def _kernel():
    """The jitted kernel for the current mode (compiled or interpreted), built on first use."""
    interpret = interpreter_enabled()
    if interpret not in _KERNELS:
        _KERNELS[interpret] = _build_kernel()
    return _KERNELS[interpret]


def _build_kernel():
    triton = _triton()
    import triton.language as tl

    @triton.jit
    def adamw_kernel(rows_ptr, block_row_ptr, BLOCK: tl.constexpr, ROW: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        row = rows_ptr + tl.load(block_row_ptr + pid).to(tl.int64) * ROW
        p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # every address is a multiple of 16 bytes (checked on the host): 128-bit accesses
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        n = tl.load(row + 4)
        start = (pid - tl.load(row + 5)) * BLOCK
        hyper = (row + 6).to(tl.pointer_type(tl.float32), bitcast=True)
        decay = tl.load(hyper + 0)
        one_minus_beta1 = tl.load(hyper + 1)
        beta2 = tl.load(hyper + 2)
        one_minus_beta2 = tl.load(hyper + 3)
        bc2_sqrt = tl.load(hyper + 4)
        eps = tl.load(hyper + 5)
        neg_step_size = tl.load(hyper + 6)
        grad_sign = tl.load(hyper + 7)
        offs = start + tl.arange(0, BLOCK)
        # Two copies of the body: full blocks without a mask (vectorised), the tail block with one.
        for MASKED in tl.static_range(2):
            if MASKED:
                mask = offs < n
                run = start + BLOCK > n
            else:
                mask = None
                run = start + BLOCK <= n
            if run:
                p = tl.load(p_ptr + offs, mask=mask)
                g = tl.load(g_ptr + offs, mask=mask) * grad_sign
                m = tl.load(m_ptr + offs, mask=mask)
                v = tl.load(v_ptr + offs, mask=mask)
                p = p * decay  # decoupled weight decay
                m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights < 0.5
                v = v * beta2 + one_minus_beta2 * g * g
                denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
                p = p + neg_step_size * tl.div_rn(m, denom)
                tl.store(p_ptr + offs, p, mask=mask)
                tl.store(m_ptr + offs, m, mask=mask)
                tl.store(v_ptr + offs, v, mask=mask)

    return adamw_kernel


def _check_param(p: torch.Tensor) -> None:
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        raise LoomError(
            f"TritonAdamW takes plain tensors, not {type(p).__name__} (sharded or wrapped parameters)",
            hint="with parallel.dp_impl=fsdp use optim.impl=torch-foreach",
        )
    if p.dtype != torch.float32 or not p.is_contiguous():
        raise LoomError(
            f"TritonAdamW updates contiguous float32 parameters; got {p.dtype}"
            + ("" if p.is_contiguous() else ", non-contiguous"),
            hint="keep master weights in fp32 (precision.dtype autocasts), or use optim.impl=torch-fused",
        )


class TritonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's algorithm, state and param-group keys; one Triton kernel launch per step.

    Arguments as torch.optim.AdamW (amsgrad is not supported). `launches` counts kernel launches.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
    ):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= float(beta) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        # torch's AdamW keys too, so a state_dict from here loads into torch.optim.AdamW unchanged
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=True,
        )
        super().__init__(params, defaults)
        self.launches = 0
        # (row numels, program → row on the device, each row's first program), rebuilt when shapes change
        self._blocks: tuple[tuple, torch.Tensor, np.ndarray] | None = None
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise LoomError(
                f"TritonAdamW needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        check_device(self.device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            _check_param(p)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also what load_state_dict calls: accept any torch Adam(W) state (steps as numbers, on a device)."""
        super().__setstate__(state)
        for group in self.param_groups:
            if group.get("amsgrad", False):
                raise LoomError("TritonAdamW does not implement amsgrad", hint="use optim.impl=torch-fused")
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                step = st["step"]
                # torch keeps `step` on the parameter's device when fused/capturable; here it lives on the
                # CPU so bias corrections are computed on the host without a device synchronisation
                st["step"] = torch.as_tensor(step, dtype=torch.float32).detach().to("cpu").clone()
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].contiguous()

    def _block_table(self, numels: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """Program → row index (on the device) and each row's first program; cached while shapes hold."""
        if self._blocks is None or self._blocks[0] != numels:
            counts = -(-np.asarray(numels, dtype=np.int64) // BLOCK)
            first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            block_row = np.repeat(np.arange(len(numels), dtype=np.int32), counts)
            self._blocks = (numels, torch.from_numpy(block_row).to(self.device), first)
        return self._blocks[1], self._blocks[2]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter that has a gradient: a single kernel launch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors: list[torch.Tensor] = []  # param, grad, exp_avg, exp_avg_sq per row (kept alive)
        steps: list[torch.Tensor] = []
        group_of_row: list[int] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise LoomError("TritonAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:  # torch's lazy initialisation: step on the CPU, moments like the parameter
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
                tensors += [p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"]]
                steps.append(state["step"])
                group_of_row.append(gi)
        if not steps:
            return loss
        compat.foreach_add_(steps, 1.0)
        rows = self._rows(tensors, steps, group_of_row)
        block_row, first = self._block_table(tuple(int(t.numel()) for t in tensors[0::4]))
        rows[:, 5] = first
        n_blocks = int(block_row.numel())
        if n_blocks == 0:
            return loss
        aligned = bool((rows[:, 0:4] % 16 == 0).all())
        rows_t = torch.from_numpy(rows)
        if self.device.type != "cpu":
            rows_t = rows_t.pin_memory().to(self.device, non_blocking=True)
        # Triton launches on the current device's current stream: make that the parameters' device
        with dev.on_device(self.device):
            _kernel()[(n_blocks,)](
                rows_t,
                block_row,
                BLOCK=BLOCK,
                ROW=ROW,
                ALIGNED=aligned,
                num_warps=NUM_WARPS,
                enable_fp_fusion=False,
            )
        self.launches += 1
        return loss

    def _rows(
        self, tensors: list[torch.Tensor], steps: list[torch.Tensor], group_of_row: list[int]
    ) -> np.ndarray:
        """The row table on the host: addresses, numel and hyper-parameters (computed in float64)."""
        n = len(steps)
        rows = np.zeros((n, ROW), dtype=np.int64)
        rows[:, 0:4] = np.asarray([t.data_ptr() for t in tensors], dtype=np.int64).reshape(n, 4)
        rows[:, 4] = [t.numel() for t in tensors[0::4]]
        gh = np.asarray(
            [
                [
                    float(g["lr"]),
                    float(g["betas"][0]),
                    float(g["betas"][1]),
                    float(g["eps"]),
                    float(g["weight_decay"]),
                    -1.0 if g["maximize"] else 1.0,
                ]
                for g in self.param_groups
            ],
            dtype=np.float64,
        )[group_of_row]
        lr, beta1, beta2, eps, wd, sign = gh.T
        step = torch.stack(steps).double().numpy()
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        hyper = rows[:, 6:10].view(np.float32)  # (n, 8) float32 view into the int64 words
        hyper[:] = np.stack(
            [
                1.0 - lr * wd,
                1.0 - beta1,
                beta2,
                1.0 - beta2,
                bias_correction2**0.5,
                eps,
                -(lr / bias_correction1),
                sign,
            ],
            axis=1,
        )
        return rows
