"""`loom plan --inter-node-gbps X`: when the link between nodes is slow, what the data-parallel sync across it
costs a step, and which of loom's remedies brings it under a tenth of the step (docs/slow-links.md).

The remedies, from the most exact to the least: bf16 gradients (half the bytes), PowerSGD of rank 4 (each
weight matrix n x m sent as (n + m) x 4 numbers, vectors whole: parallel.grad_compression), DiLoCo (the fp32
parameters once every H steps instead of the gradients every step: parallel.diloco_inner_steps). The plain
sync across nodes: each GPU all-reduces its piece of the gradients (a ring: twice its bytes over the link),
the whole stage's under DDP, its shard under HSDP (FSDP's gathers stay inside a node); each remedy scales it.
The sync is taken as exposed: on a slow link it outlasts the backward it overlaps.
"""

from __future__ import annotations

from loom.plan.estimate import GB, Candidate, Cluster
from loom.plan.shapes import ModelShape

TARGET = 0.10  # the share of a step the sync across nodes may take before a remedy pays off
RANK = 4
DILOCO_H = (20, 100, 500)


def powersgd_factor(shape: ModelShape, rank: int = RANK) -> float:
    """Bytes PowerSGD sends over the bytes of the whole gradients (torch's rule: a matrix is compressed when
    (n + m) r x 2 < n m; everything else, norms and biases, goes whole)."""
    C, F, kv, V = shape.n_embd, shape.ffn_width, shape.kv_dim, shape.padded_vocab
    mats = [(C, C), (C, C), (kv, C), (kv, C)] + [(F, C)] * (3 if shape.mlp == "swiglu" else 2)
    whole = sent = 0
    for n, m in mats * shape.n_layer + [(V, C)]:
        whole += n * m
        r = min(n, m, rank)
        sent += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    rest = max(shape.param_count() - whole, 0)  # vectors, a second embedding table
    return (sent + rest) / (whole + rest)


def advice(c: Candidate, cluster: Cluster, shape: ModelShape, gbps: float, grad_bytes: float) -> list[str]:
    """Lines for the report: the plain sync across nodes of layout `c`, each remedy's, the verdict
    (`grad_bytes`: bytes of a gradient element in the all-reduce; DiLoCo sends fp32 parameters)."""
    if cluster.gpus <= cluster.gpus_per_node:
        return [f"slow links  --inter-node-gbps {gbps:g}: one node, nothing crosses it"]
    compute = c.step_time_s - c.comm_s  # compute and pipeline bubble
    shard = c.dp // c.replicate if c.zero == 3 else 1
    piece = shape.param_count() / (c.tp * c.pp) / shard
    plain = 2 * (c.replicate - 1) / c.replicate * piece * grad_bytes / (cluster.inter_bw * GB)
    ddp = "" if c.zero == 0 else ", with dp_impl=ddp"
    options = [
        ("plain DDP/HSDP", 1.0),
        (f"bf16 gradients (grad_compression=bf16{ddp})", 0.5 * min(1.0, 4 / grad_bytes)),
        (f"PowerSGD rank {RANK} (grad_compression=powersgd{ddp})", powersgd_factor(shape)),
    ]
    # DiLoCo: the fp32 parameter change all-reduced once in H steps instead of the gradients every step
    options += [(f"DiLoCo H={h} (parallel.diloco_inner_steps={h})", 4 / grad_bytes / h) for h in DILOCO_H]
    if c.replicate < 2:
        return ["slow links  layout #1 does not replicate across nodes (dp_replicate=1): see its rows"]
    lines = [
        f"slow links  inter-node {gbps:g} Gbit/s per node = {cluster.inter_bw * 1e3:.3g} MB/s per GPU; "
        f"layout #1's step: {compute:.2f} s of compute, data-parallel sync across nodes {plain:.2f} s"
    ]
    verdict = None
    for name, factor in options:
        t = plain * factor
        share = t / (compute + t)
        lines.append(f"  {name:<62} {t:>9.3f} s/step  {share:>6.1%} of the step")
        if verdict is None and share <= TARGET:
            verdict = name
    if verdict == "plain DDP/HSDP":
        lines.append(f"  -> the link is fast enough: the plain sync takes <= {TARGET:.0%} of a step")
    elif verdict:
        lines.append(
            f"  -> pays off: {verdict}, the most exact remedy that brings the sync under {TARGET:.0%}"
        )
    else:
        lines.append(
            f"  -> even DiLoCo H={DILOCO_H[-1]} leaves the sync above {TARGET:.0%}: a faster link or fewer nodes"
        )
    return lines
