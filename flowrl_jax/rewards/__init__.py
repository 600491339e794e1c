"""Rewards: the exact evaluator of the embedded shapes world (`shapes_eval`)."""
