"""The device rewards at their real sizes, with random weights: GFLOP per image by hand and by XLA's count, their
share of an SD3.5-M Flow-GRPO iteration on paper, and images/s on this machine at tiny shapes.

    python benchmarks/reward_throughput.py [--out benchmarks/results/reward_throughput.json]

Per image, one reward call = the image tower at 224 px + the text tower on one prompt (77 tokens); the aesthetic
score has no text tower. Hand count of a pre-LN ViT layer on N tokens of width D with MLP width M:
2 N (4 D^2 + 2 D M) for the matmuls + 4 N^2 D for the attention's two products; the patch embedding 2 (N - 1) (3 p^2) D,
the projections 2 D P. For the gradient methods (LeapAlign, spatial credit) a reward call is a forward and a backward
to the pixels, ~3x the forward. The iteration's own FLOPs per image (168.4 TFLOP at 512 px, 10 steps, 9 trained) are
`benchmarks/throughput_on_paper.py`'s. The images/s figure is for tiny towers (width 64, 2 layers, 32 px) on this CPU:
a check that the path runs jitted, not a forecast for a real model.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from flowrl_jax.models import clip_text, clip_vision

ITERATION_TFLOP_PER_IMAGE = 168.4  # benchmarks/throughput_on_paper.py (SD3.5-M, 512 px, flow_grpo's settings)
TOWERS = {  # the hub configs' shapes (config.json of each model)
    "ViT-H/14 (PickScore)": dict(vision=dict(hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32,
                                             num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu"),
                                 text=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, projection_dim=1024,
                                           num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu")),
    "ViT-L/14 (CLIPScore, aesthetic)": dict(vision=dict(hidden_size=1024, intermediate_size=4096, projection_dim=768, num_hidden_layers=24,
                                                        num_attention_heads=16, image_size=224, patch_size=14, hidden_act="quick_gelu"),
                                            text=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
                                                      num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                                      hidden_act="quick_gelu")),
}
REWARDS = {"pickscore": ("ViT-H/14 (PickScore)", True), "clipscore": ("ViT-L/14 (CLIPScore, aesthetic)", True),
           "aesthetic": ("ViT-L/14 (CLIPScore, aesthetic)", False)}


def hand_gflop(vision: dict, text: dict | None) -> float:
    d, m, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    n = (vision["image_size"] // p) ** 2 + 1
    flops = vision["num_hidden_layers"] * (2 * n * (4 * d * d + 2 * d * m) + 4 * n * n * d)
    flops += 2 * (n - 1) * 3 * p * p * d + 2 * d * vision["projection_dim"]
    if text is not None:
        d, m, n = text["hidden_size"], text["intermediate_size"], text["max_position_embeddings"]
        flops += text["num_hidden_layers"] * (2 * n * (4 * d * d + 2 * d * m) + 4 * n * n * d) + 2 * d * text["projection_dim"]
    return flops / 1e9


def xla_gflop(vision: dict, text: dict | None) -> float:
    """XLA's cost analysis of the towers' forward on one image (and one prompt), from abstract params."""
    v = clip_vision.CLIPVisionEncoder(**vision)
    pixels = jax.ShapeDtypeStruct((1, vision["image_size"], vision["image_size"], 3), jnp.float32)
    params = {"vision": jax.eval_shape(lambda: v.init(jax.random.PRNGKey(0), *v.dummy_inputs()))["params"]}
    fns = [lambda p, x, i: v.apply({"params": p["vision"]}, x)]
    ids = jax.ShapeDtypeStruct((1, 77), jnp.int32)
    if text is not None:
        t = clip_text.CLIPTextEncoder(**text, scan_layers=False)  # XLA's cost analysis counts a loop body once
        params["text"] = jax.eval_shape(lambda: t.init(jax.random.PRNGKey(0), jnp.zeros((1, 77), jnp.int32)))["params"]
        fns.append(lambda p, x, i: t.apply({"params": p["text"]}, i, None, hidden_layer=None)[1])

    def forward(p, x, i):
        return sum(jnp.sum(f(p, x, i)) for f in fns)

    cost = jax.jit(forward).lower(params, pixels, ids).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]) / 1e9


def tiny_images_per_s(batch: int = 16, repeats: int = 5) -> dict:
    """A tiny CLIP pair's reward (forward) and its gradient in the pixels, jitted, images/s on this machine."""
    v = clip_vision.CLIPVisionEncoder(hidden_size=64, intermediate_size=256, projection_dim=32, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=32, patch_size=8)
    t = clip_text.CLIPTextEncoder(vocab_size=100, hidden_size=64, intermediate_size=256, projection_dim=32, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=16)
    key = jax.random.PRNGKey(0)
    params = {"vision": v.init(key, *v.dummy_inputs())["params"], "text": t.init(key, jnp.zeros((1, 16), jnp.int32))["params"]}
    x = jax.random.normal(key, (batch, 32, 32, 3))
    ids = jnp.ones((batch, 16), jnp.int32)

    def score(p, x, i):
        a = v.apply({"params": p["vision"]}, x)
        b = t.apply({"params": p["text"]}, i, None, hidden_layer=None)[1]
        return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1))

    out = {}
    for name, fn in (("forward", jax.jit(score)), ("grad", jax.jit(jax.grad(lambda p, x, i: score(p, x, i).sum(), argnums=1)))):
        jax.block_until_ready(fn(params, x, ids))  # compile
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn(params, x, ids))
        out[name] = batch * repeats / (time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/reward_throughput.json")
    args = parser.parse_args()
    rows = {}
    for name, (tower, with_text) in REWARDS.items():
        cfg = TOWERS[tower]
        text = cfg["text"] if with_text else None
        hand, xla = hand_gflop(cfg["vision"], text), xla_gflop(cfg["vision"], text)
        rows[name] = {"tower": tower, "gflop_hand": hand, "gflop_xla": xla,
                      "share_grpo": xla / (ITERATION_TFLOP_PER_IMAGE * 1e3),
                      "share_gradient_methods": 3 * xla / (ITERATION_TFLOP_PER_IMAGE * 1e3)}
    tiny = tiny_images_per_s()
    print(f"per image: GFLOP by hand and by XLA, and the share of an SD3.5-M Flow-GRPO iteration ({ITERATION_TFLOP_PER_IMAGE} TFLOP "
          "per image); x3 for a forward + backward (LeapAlign, spatial credit)")
    print(f"{'reward':10s} {'tower':32s} {'hand':>8s} {'XLA':>8s} {'share':>8s} {'share x3':>9s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['tower']:32s} {r['gflop_hand']:8.1f} {r['gflop_xla']:8.1f} {100 * r['share_grpo']:7.3f}% "
              f"{100 * r['share_gradient_methods']:8.3f}%")
    print(f"tiny towers on this machine ({jax.devices()[0].platform}): forward {tiny['forward']:.0f} images/s, "
          f"gradient in the pixels {tiny['grad']:.0f} images/s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rewards": rows, "tiny_images_per_s": tiny, "iteration_tflop_per_image": ITERATION_TFLOP_PER_IMAGE,
                   "device": str(jax.devices()[0])}, f, indent=2)


if __name__ == "__main__":
    main()
