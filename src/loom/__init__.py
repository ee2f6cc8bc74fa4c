"""loom: train decoder-only language models (gpt2, llama and plug-in families) from one CPU core to many GPU nodes."""

__version__ = "0.1.0"
