"""Process groups and topology on torch.distributed."""
