"""The latent world's text-encoding trade-off at SD3.5's real shapes: encoders on the fly vs a cache.

    python benchmarks/text_cache.py [--t5_tokens 128] [--out benchmarks/results/text_cache.json]

No weights needed: parameter counts from `jax.eval_shape` of our CLIP-L, CLIP-G and T5-XXL modules at SD3.5's
configs, encoding FLOPs per prompt from XLA's cost analysis of the lowered (not compiled) encoders, and the cache's
bytes per prompt from its shape. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.clip_text import CLIPTextEncoder
from flowrl_jax.worlds.sd3.pipeline import SD35_MEDIUM
from flowrl_jax.models.t5 import T5Encoder

# SD3.5's text_encoder / text_encoder_2 / text_encoder_3 config.json values (the hyper-parameters that set the shapes).
CLIP_L, CLIP_G, T5_XXL = (SD35_MEDIUM[k] for k in ("clip_l", "clip_g", "t5"))
JOINT_DIM, POOLED_DIM, CLIP_TOKENS = 4096, 2048, 77


def _params_and_flops(module, length: int) -> tuple[int, float]:
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    params = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, length), jnp.int32)))["params"]
    count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    cost = jax.jit(lambda p, i: module.apply({"params": p}, i)).lower(params, ids).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return count, float(cost["flops"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t5_tokens", type=int, default=128, help="flow_grpo's max_sequence_length (diffusers' default: 256)")
    parser.add_argument("--out", default="benchmarks/results/text_cache.json")
    args = parser.parse_args()
    rows = {}
    for name, module, length in (("CLIP-L", CLIPTextEncoder(**CLIP_L, dtype=jnp.bfloat16), CLIP_TOKENS),
                                 ("CLIP-G", CLIPTextEncoder(**CLIP_G, dtype=jnp.bfloat16), CLIP_TOKENS),
                                 ("T5-XXL", T5Encoder(**T5_XXL, dtype=jnp.bfloat16), args.t5_tokens)):
        count, flops = _params_and_flops(module.clone(scan_layers=False), length)  # XLA counts a loop body once
        rows[name] = {"params": count, "bf16_GB": 2 * count / 1e9, "GFLOP_per_prompt": flops / 1e9}
    cache_bytes = 2 * ((CLIP_TOKENS + args.t5_tokens) * JOINT_DIM + POOLED_DIM)  # bf16 tokens + pooled
    encoders_bytes = sum(2 * r["params"] for r in rows.values())
    result = {"t5_tokens": args.t5_tokens, "encoders": rows, "encoders_bf16_GB": encoders_bytes / 1e9,
              "cache_MB_per_prompt": cache_bytes / 1e6, "break_even_prompts": int(encoders_bytes // cache_bytes),
              "encode_GFLOP_per_prompt": sum(r["GFLOP_per_prompt"] for r in rows.values())}
    print(f"{'encoder':8s} {'params':>14s} {'bf16 GB':>8s} {'GFLOP/prompt':>13s}")
    for name, r in rows.items():
        print(f"{name:8s} {r['params']:14,d} {r['bf16_GB']:8.2f} {r['GFLOP_per_prompt']:13.1f}")
    print(f"encoders on the fly: {result['encoders_bf16_GB']:.2f} GB of weights, {result['encode_GFLOP_per_prompt']:.0f} GFLOP "
          f"per encoded row; cache: {result['cache_MB_per_prompt']:.2f} MB per prompt (T5 at {args.t5_tokens} tokens), "
          f"the encoders' memory at {result['break_even_prompts']:,d} prompts")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
