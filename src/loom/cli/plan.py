"""`loom plan`: the layout planner (loom.plan); with --check its top layouts are dry-run (loom.dryrun.check)."""

from __future__ import annotations


def plan(argv: list[str]) -> int:
    """`loom plan ...`; with --check [--gpu NAME] the planner's top layouts are also dry-run (loom.dryrun.check)
    and each measurement is printed beside the planner's estimate."""
    from loom.plan import plan_main

    if "--check" not in argv:
        return plan_main(argv)
    from loom.dryrun.check import check_checkable, plan_check
    from loom.plan.report import build_parser, finetune_overrides, run_plan

    p = build_parser()
    p.add_argument("--check", action="store_true", help="dry-run the top layouts (loom train --dry-run)")
    p.add_argument("--gpu", default="H100", help="with --check: the GPU the dry run takes (default H100)")
    args = p.parse_args(argv)
    shape, cluster, wl, cands = run_plan(args)
    check_checkable(shape)
    plain = [a for a in argv if a != "--check" and not a.startswith("--gpu=")]
    if "--gpu" in plain:  # "--gpu NAME": both go
        i = plain.index("--gpu")
        del plain[i : i + 2]
    plan_main(plain)
    top = [c for c in cands if c.fits][: min(args.top, 3)]
    return plan_check(args.model, shape, cluster, wl, top, args.gpu, finetune_overrides(args))
