"""Tuning OEA beyond the paper: calibrating adaptive / per-layer k0, comparing policies at matched T."""
