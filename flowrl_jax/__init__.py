"""flowrl_jax: RL fine-tuning of flow-matching DiTs in JAX (README.md)."""
import os

# transformers serves tokenizers and configs here (never models). Without PyTorch it opens every run with the
# advisory "PyTorch was not found. Models won't be available ...", which a newcomer reads as an error. This switch
# silences transformers' advisory warnings only (`logger.warning_advice`); its other warnings still print.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
