"""Samplers: the sigma schedule (schedule.py), the transition kernels (kernels.py) and the scanned
trajectories with CFG (rollout.py)."""
