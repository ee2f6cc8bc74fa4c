"""The moe family folder: GPT with routed SwiGLU experts (moe.py), its config keys, checks, preset and hooks
(family.py), its parallel plan with expert parallelism (moe_parallel.py) and its transformers mapping
(hf_moe.py: Qwen3-MoE)."""
