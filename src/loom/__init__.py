"""loom: train GPT-style language models from one CPU core to many GPU nodes."""

__version__ = "0.1.0"
