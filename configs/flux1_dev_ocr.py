"""Flow-GRPO on FLUX.1-dev, OCR prompts: flow_grpo's FLUX recipe (`common.flux1_dev_train_config`) with the OCR reward
and KL beta 0.04.

upstream flow_grpo ships no FLUX OCR preset; this one is the FLUX recipe with its SD3.5 OCR run's beta 0.04, as the
public flow_grpo-derived FLUX OCR configs set it (SHI-Labs/MapReduce-LoRA `config/grpo.py:general_ocr_flux`: 6 steps,
noise level 0.9, groups of 24, beta 0.04, lr 3e-4).

    pip install -r requirements-ocr.txt          # the OCR engine (RapidOCR, offline)
    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/train.txt data/ocr --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/test.txt data/ocr --split test
    python -m flowrl_jax.main --config configs/flux1_dev_ocr.py:v5p-8 --workdir gs://bucket/runs/flux_ocr \\
        --config.world.pipeline=/path/to/FLUX.1-dev --config.world.train_prompts=data/ocr --config.world.test_prompts=data/ocr

The reward runs on the host (`rewards/ocr.py`); on a pod, serve it beside each host's trainer (README "Rewards").
The argument picks the memory plan (`common.FLUX_MEMORY_PLANS`).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.flux1_dev_train_config(rewards=(("ocr", 1.0),), beta=0.04, plan=arg or "v5p-8")
    config.lock()
    return config
