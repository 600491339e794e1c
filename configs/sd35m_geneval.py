"""Flow-GRPO on SD3.5-Medium, GenEval prompts (flow_grpo `config/grpo.py:geneval_sd3`): beta 0.04.

    python -m flowrl_jax.data.datasets flow_grpo/dataset/geneval/train_metadata.jsonl data/geneval --split train
    python -m flowrl_jax.data.datasets flow_grpo/dataset/geneval/test_metadata.jsonl data/geneval --split test
    python -m flowrl_jax.main --config configs/sd35m_geneval.py:v5p-8 --workdir gs://bucket/runs/geneval \\
        --config.world.pipeline=/path/to/stable-diffusion-3.5-medium \\
        --config.world.train_prompts=data/geneval --config.world.test_prompts=data/geneval

GenEval's detector (mmdet Mask2Former) is not in this library; flow_grpo's reward-server runs it. Point the trainer at
the server you already run (its pickle answers are read with an unpickler that admits only plain data, README "Rewards"):

    ... --config.train.rewards="(('flow_grpo:geneval@http://127.0.0.1:18085', 1.0),)" --config.train.score_while_sampling=True

Without it the default reward is the model-free JPEG compressibility, so the preset runs end to end.
The argument picks the memory plan of the hardware (`common.MEMORY_PLANS`: v5p-8 (default), v6e-8, gpu, v5p-64, v6e-64;
README "Memory plan").
"""
from configs import common


def get_config(arg: str = ""):
    config = common.sd35m_train_config(beta=0.04, plan=arg or "v5p-8")
    config.lock()
    return config
