"""Will it fit? A dry run of the real job at any world size, on one CPU (layer 5).

fake.py    one process as rank r of a world of N (torch's fake process group) with fake tensors, and what the
           real path needs adapting to run there
step.py    one rank built through loom's real path (family spec, parallelize, optimizer) and trained one step
           under torch's memory tracker
layout.py  the job's layout checked as a real job checks it, the GPU's precision, the ranks that differ, the
           planner's estimate of the same layout and its next best one
blocks.py  a rank stepped in full, or with fewer blocks and micro-batches and extended along the line (exact),
           each step in a child process of its own
report.py  the table, the verdict and `dryrun_main` (what `loom train --dry-run` calls)
check.py   `plan_check`: the planner's top layouts dry-run beside its estimates (what `loom plan --check` calls)

Device. The fake tensors live on 'cpu'. A fake 'cuda' device would need CUDA's runtime, which a CPU build of
torch lacks (FSDP2 makes CUDA streams, the mesh sets the current device), and on 'cpu' loom runs unchanged. Where
the GPU's path differs the dry run takes the GPU's: FSDP's mixed precision as it resolves on a GPU
(layout.gpu_config: bf16 gathered parameters when training in bf16), precision.dtype=auto as on the --gpu, the
model's CPU fast paths off, autocast's fp32 policy for the norms and CUDA's fused RMSNorm (fake.gpu_paths). Not
counted: the CUDA context, NCCL's buffers and the caching allocator's fragmentation, which the headroom (10 % of
the GPU's memory, as loom.plan) stands for.

Nothing here is imported with the package: torch's trackers load when a dry run starts.
"""


def dryrun_main(argv: list[str]) -> int:
    """`loom train --dry-run --world N ...`: see loom.dryrun.report.dryrun_main."""
    from loom.dryrun.report import dryrun_main as main

    return main(argv)
