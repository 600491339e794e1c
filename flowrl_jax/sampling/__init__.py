"""Samplers: the sigma schedule (schedule.py) and the deterministic CFG ODE sampler (ode.py)."""
