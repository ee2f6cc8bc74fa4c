"""Benchmarks behind `loom bench` (layer 6: may import anything; the library never imports them).

* `comm.py`: `loom bench comm`, collective bandwidth in the style of nccl-tests (time, algbw, busbw)
  for torch.distributed, mpi4py's built-in collectives and loom's own ring collectives.
"""
