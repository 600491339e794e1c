"""Train the learned reward: `python -m flowrl_jax.main --config configs/train_reward.py --workdir workdirs/reward`.

Variant "smoke": a few steps on little data (what the tests run); `--config.reward.base` picks the
base model whose samples join the data (a shipped name or a pretrain workdir).
"""
from configs import common


def get_config(arg: str = ""):
    config = common.base_config("train_reward")
    config.reward = dict(base="shapes32", rendered=16000, generated_train=23040, generated_test=960, cfgs=(1.0, 1.5, 3.0, 5.0),
                         width=96, heads=4, steps=4000, batch_size=96, lr=1e-3, loss="bce", generated_fraction=0.5, export="",
                         relabel_fraction=0.5, flip_fraction=0.5, count_weight=0.1, palette_features=True,
                         mirror_average=True)
    if arg == "smoke":
        config.reward.update(rendered=64, generated_train=16, generated_test=16, cfgs=(3.0,), width=16, heads=2, steps=4, batch_size=8)
    config.lock()
    return config
