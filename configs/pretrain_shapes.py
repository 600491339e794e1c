"""Pretrain the shapes world's base model: `python -m flowrl_jax.main --config configs/pretrain_shapes.py --workdir workdirs/pretrain`.

Variants: "" (the 45-minute recipe: batch 32, lr 6e-4, 9,000 steps; 41 min on 2 CPU cores, overall strict 0.255),
"shipped" (the recipe of the shipped `shapes32`: batch 48, lr 4e-4, 12,000 steps; 80 min here), "64" (the default
recipe on 64x64 scenes: 256 tokens at patch 4) and "smoke" (a tiny model, a few steps: what the tests run).
WORKSPACE_NOTES.md, "The shipped base model", has both runs' figures.
"""
from configs import common


def get_config(arg: str = ""):
    smoke = arg == "smoke"
    config = common.base_config("pretrain")
    config.model = common.model_config("shapes32")
    config.text = dict(max_len=10, width=128, depth=2, heads=4)
    config.pretrain = dict(
        steps=9000, batch_size=32, lr=6e-4, warmup_steps=300, weight_decay=0.01, grad_clip=1.0, ema_decay=0.999,
        caption_dropout=0.1, t_logit_mean=0.0, t_logit_std=1.0,
        log_every=25, eval_every=1000, eval_per_category=16, eval_batch_size=96, checkpoint_every=500, keep_checkpoints=3,
        sample_steps=20, sample_cfg=4.0, sample_shift=1.0,
    )
    if arg == "shipped":
        config.pretrain.update(steps=12000, batch_size=48, lr=4e-4)
    if arg == "64":
        config.model.update(sample_size=64, pos_embed_max_size=16)
    if smoke:
        config.model.update(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                            caption_projection_dim=32, pooled_projection_dim=32)
        config.text.update(width=32, depth=1, heads=2)
        config.pretrain.update(steps=6, batch_size=8, warmup_steps=2, log_every=2, eval_every=6, eval_per_category=2,
                               eval_batch_size=16, checkpoint_every=3, sample_steps=4)
    config.lock()
    return config
