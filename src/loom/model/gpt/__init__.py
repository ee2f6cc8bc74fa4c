"""The gpt family folder: loom's GPT (gpt.py) with the gpt2 and llama presets (family.py), its parallel plan
(gpt_parallel.py) and Llama's transformers mapping (hf_llama.py; GPT-2's is loom.model.hf, the HF front door)."""
