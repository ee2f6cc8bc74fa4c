"""Imported at interpreter start by every process of a test job that puts this folder on PYTHONPATH.

LOOM_CHECK_DEVICES_AS=cuda: every tensor collective issued through torch.distributed's Python API is checked
against the device types the group's backend would serve in a job on that device, as loom configures it
(`loom.distributed.process_group.backend_for`). A CPU machine cannot run NCCL, so the check is made against
the backend string loom *would* pass on a GPU: an NCCL-only group cannot take a CPU tensor, and every
control-plane value on a CPU machine is a CPU tensor, exactly as in a GPU job. Each process writes what it
saw to LOOM_CHECK_OUT/rank<N>.json: the number of collectives checked, and the ones that would fail.
LOOM_CHECK_BACKEND replaces loom's backend string (to show the check catches an NCCL-only group).
"""

import atexit
import json
import os
import traceback

if os.environ.get("LOOM_CHECK_DEVICES_AS"):
    import torch
    import torch.distributed as dist

    _job_device = torch.device(os.environ["LOOM_CHECK_DEVICES_AS"])
    _seen = {"checked": 0, "cpu_tensors": 0, "violations": []}
    _explicit: dict = {}  # group -> backend string given to new_group

    def _served(backend: str) -> set:
        backend = str(backend)
        if ":" in backend:
            return {part.split(":")[0].strip() for part in backend.split(",")}
        return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}}.get(backend, {"cpu"})

    def _backend_of(group):
        if group is not None and group in _explicit:
            return _explicit[group]
        if os.environ.get("LOOM_CHECK_BACKEND"):  # the test of the check: a given backend string instead
            return os.environ["LOOM_CHECK_BACKEND"]
        from loom.distributed.process_group import backend_for

        return backend_for(_job_device)  # the default group's, inherited by sub-groups and device meshes

    def _check(name, tensors, group):
        served = _served(_backend_of(group))
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            dev = t.device.type
            _seen["checked"] += 1
            _seen["cpu_tensors"] += dev == "cpu"
            if dev not in served:
                where = "".join(traceback.format_stack(limit=6)[:-2])
                _seen["violations"].append(
                    f"{name}: a {dev} tensor on a group served for {sorted(served)}\n{where}"
                )

    def _wrap(name, tensor_args):
        fn = getattr(dist, name)

        def wrapped(*args, **kwargs):
            tensors = []
            for i in tensor_args:
                if i < len(args):
                    a = args[i]
                    tensors.extend(a if isinstance(a, (list, tuple)) else [a])
            _check(name, tensors, kwargs.get("group"))
            return fn(*args, **kwargs)

        setattr(dist, name, wrapped)

    for _name, _idx in {
        "all_reduce": (0,),
        "broadcast": (0,),
        "reduce": (0,),
        "all_gather": (0, 1),
        "all_gather_into_tensor": (0, 1),
        "reduce_scatter_tensor": (0, 1),
        "reduce_scatter": (0, 1),
        "all_to_all_single": (0, 1),
        "gather": (0,),
        "scatter": (0,),
        "send": (0,),
        "recv": (0,),
        "isend": (0,),
        "irecv": (0,),
    }.items():
        _wrap(_name, _idx)

    _new_group = dist.new_group

    def _recording_new_group(*args, **kwargs):
        group = _new_group(*args, **kwargs)
        if kwargs.get("backend") is not None:
            _explicit[group] = kwargs["backend"]
        return group

    dist.new_group = _recording_new_group

    def _write():
        out = os.environ.get("LOOM_CHECK_OUT")
        if out and "RANK" in os.environ:  # a worker (the launching parent has no rank)
            with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
                json.dump(_seen, f)

    atexit.register(_write)
    _destroy = dist.destroy_process_group

    def _write_then_destroy(*args, **kwargs):  # loom's ranks leave with os._exit, after destroying the group
        _write()
        return _destroy(*args, **kwargs)

    dist.destroy_process_group = _write_then_destroy
