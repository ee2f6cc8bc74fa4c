"""Parallelism applied to a single-device model from outside: DDP, FSDP2, ZeRO, TP/SP, PP and MPI-DP."""
