"""Flow-GRPO on SD3.5-Medium, OCR prompts (flow_grpo `config/grpo.py`'s OCR setting): beta 0.04, the OCR reward.

    pip install -r requirements-ocr.txt          # the OCR engine (RapidOCR: PaddleOCR's PP-OCRv4 as ONNX, offline)
    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/train.txt data/ocr --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/ocr/test.txt data/ocr --split test
    python -m flowrl_jax.main --config configs/sd35m_ocr.py:v5p-8 --workdir gs://bucket/runs/ocr \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.train_prompts=data/ocr --config.world.test_prompts=data/ocr

The reward (`rewards/ocr.py`) is 1 - the edit distance of what the OCR engine reads to the prompt's quoted text, over
its length, scored on the host. On a pod, serve it beside each host's trainer and score each rollout chunk while the
next samples (README "Rewards"):

    python -m flowrl_jax.rewards.serve --reward ocr --port 18090 &
    ... --config.train.rewards="(('remote:ocr@http://127.0.0.1:18090', 1.0),)" --config.train.score_while_sampling=True

The argument picks the memory plan of the hardware (`common.MEMORY_PLANS`: v5p-8 (default), v6e-8, gpu, v5p-64, v6e-64;
README "Memory plan").
"""
from configs import common


def get_config(arg: str = ""):
    config = common.sd35m_train_config(rewards=(("ocr", 1.0),), beta=0.04, plan=arg or "v5p-8")
    config.lock()
    return config
