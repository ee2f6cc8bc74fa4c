"""Optimizers, learning-rate schedules and loss scaling."""
