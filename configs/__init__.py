"""Run configs: one Python file per run (`get_config(arg)`); `common.py` holds what they share."""
