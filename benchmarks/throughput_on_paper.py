"""Flow-GRPO throughput at scale, on paper: FLOPs per image of one iteration of `configs/sd35m_*.py` (SD3.5-Medium,
512 px) from our hand count and XLA's, and the images per hour a slice would reach at a stated utilisation.

    python benchmarks/throughput_on_paper.py [--mfu 0.35] [--out benchmarks/results/throughput_on_paper.json]

No weights: every count comes from abstract shapes. Per image (one rollout row):
  rollout   T steps x 2 (CFG) MMDiT forwards                          = 2 T F
  update    per trained step: the policy's CFG pair forward+backward    = 2 x 2 F  (LoRA: the backward's weight
            gradients are the adapters' only, so backward ~ the activation gradients ~ F)
            plus the reference's CFG pair forward for the KL            = 2 F      -> 6 F per trained step
  text      CLIP-L + CLIP-G + T5-XXL on the row (benchmarks/text_cache.py)
  decode    the VAE decoder on the row's latents
F is the MMDiT forward at 64x64 latents and 77 + 128 text tokens: `models/flops.py`'s hand count, checked against
XLA's cost analysis of the lowered forward (printed side by side).
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from flowrl_jax.models import flops, presets
from flowrl_jax.models.mmdit import MMDiT
from flowrl_jax.worlds.sd3.pipeline import SD35_MEDIUM
from flowrl_jax.models.vae import AutoencoderKL

# Peak dense bf16 FLOP/s per chip, from the vendors' spec sheets.
CHIPS = {"TPU v5p": 459e12, "TPU v6e": 918e12, "H100/H200 SXM": 989e12, "A100": 312e12}
SLICES = {"v5p-64 (32 chips)": ("TPU v5p", 32), "v6e-64 (64 chips)": ("TPU v6e", 64), "32 x H100 (flow_grpo's count)": ("H100/H200 SXM", 32)}
SD3_VAE = SD35_MEDIUM["vae"]
TEXT_GFLOP = 1310.2  # per row, T5 at 128 tokens: benchmarks/text_cache.py


def _xla_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=0.35, help="the utilisation assumed (model FLOPs / peak)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trained_steps", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/throughput_on_paper.json")
    args = parser.parse_args()

    dit = MMDiT(**presets.PRESETS["sd35_medium"], dtype=jnp.bfloat16, scan_blocks="never")  # XLA counts a loop body once
    x, t, txt, pooled = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dit.dummy_inputs(1, 77 + 128, 64, 64))
    params = jax.eval_shape(lambda: dit.init(jax.random.PRNGKey(0), *dit.dummy_inputs(1, 1, 8, 8)))["params"]
    hand = flops.forward_flops(dit, params, 1, 64, 64, 77 + 128)
    xla = _xla_flops(lambda p, *a: dit.apply({"params": p}, *a), params, x, t, txt, pooled)
    vae = AutoencoderKL(**SD3_VAE, dtype=jnp.bfloat16)
    vae_params = jax.eval_shape(lambda: vae.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3))))["params"]
    decode = _xla_flops(lambda p, z: vae.apply({"params": p}, z, method="decode"), vae_params, jax.ShapeDtypeStruct((1, 64, 64, 16), jnp.float32))

    parts = {"rollout": 2 * args.steps * hand, "update": 6 * args.trained_steps * hand, "text": TEXT_GFLOP * 1e9, "decode": decode}
    per_image = sum(parts.values())
    result = {"mmdit_forward_GFLOP": {"hand": hand / 1e9, "xla": xla / 1e9}, "vae_decode_GFLOP": decode / 1e9,
              "per_image_TFLOP": {k: v / 1e12 for k, v in parts.items()} | {"total": per_image / 1e12}, "mfu": args.mfu, "slices": {}}
    print(f"MMDiT forward (SD3.5-M, 512 px, 205 text tokens): hand {hand / 1e9:,.0f} GFLOP, XLA {xla / 1e9:,.0f} GFLOP "
          f"({100 * (xla / hand - 1):+.1f}%); VAE decode {decode / 1e9:,.0f} GFLOP")
    print("per image: " + ", ".join(f"{k} {v / 1e12:.1f}" for k, v in parts.items()) + f" -> {per_image / 1e12:.1f} TFLOP")
    print(f"{'slice':32s} {'peak PFLOP/s':>12s} {'images/h at ' + format(args.mfu, '.0%'):>18s} {'s per 1,152 images':>19s}")
    for name, (chip, count) in SLICES.items():
        peak = CHIPS[chip] * count
        per_hour = 3600 * args.mfu * peak / per_image
        result["slices"][name] = {"peak_PFLOPs": peak / 1e15, "images_per_hour": per_hour, "s_per_1152": 1152 * 3600 / per_hour}
        print(f"{name:32s} {peak / 1e15:12.1f} {per_hour:18,.0f} {1152 * 3600 / per_hour:19.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
