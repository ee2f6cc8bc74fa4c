"""Evaluation: validation loss and perplexity of a run (and downstream tasks later)."""
