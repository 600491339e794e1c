"""MMDiT forward and forward+backward time and achieved GFLOP/s, for the tiny and small presets.

    python benchmarks/dit_forward.py [--presets tiny,small] [--batch 8] [--repeats 10]

FLOPs are the hand count of `flowrl_jax/models/flops.py` (every dense kernel `2 * rows * in * out`
on its stream's rows, plus `4 * B * S^2 * D` per attention), with forward+backward = 3x forward.
XLA's own `cost_analysis()` count is printed beside it as a cross-check. Times are medians of
`--repeats` calls after one warm-up, with `block_until_ready`. Writes benchmarks/results/dit_forward.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from configs.common import model_config
from flowrl_jax.models import build_mmdit, flops


def _median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(preset: str, batch: int, text_len: int, repeats: int) -> dict:
    model = build_mmdit(model_config(preset))
    x, _, txt, pooled = model.dummy_inputs(batch, text_len)
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    inputs = (jax.random.normal(keys[0], x.shape), jax.random.uniform(keys[1], (batch,)),
              jax.random.normal(keys[2], txt.shape), jax.random.normal(keys[3], pooled.shape))
    params = jax.jit(model.init)(keys[4], *inputs)["params"]
    target = jax.random.normal(keys[4], x.shape)

    forward = jax.jit(lambda p, *a: model.apply({"params": p}, *a))
    train = jax.jit(jax.value_and_grad(lambda p, *a: jnp.mean((model.apply({"params": p}, *a) - target) ** 2)))
    unrolled = model.clone(scan_blocks="never")  # XLA's cost analysis counts a loop body once, not once per trip
    xla = jax.jit(lambda p, *a: unrolled.apply({"params": p}, *a)).lower(params, *inputs).compile().cost_analysis()
    xla_flops = (xla[0] if isinstance(xla, list) else xla)["flops"]

    hand = flops.forward_flops(model, params, batch, model.sample_size, model.sample_size, text_len)
    fwd_s = _median_time(forward, (params, *inputs), repeats)
    train_s = _median_time(train, (params, *inputs), repeats)
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    return dict(preset=preset, params=n_params, batch=batch, tokens=(model.sample_size // model.patch_size) ** 2,
                text_len=text_len, forward_ms=1e3 * fwd_s, fwd_bwd_ms=1e3 * train_s,
                forward_gflops=hand / 1e9, xla_forward_gflops=xla_flops / 1e9,
                forward_gflop_s=hand / fwd_s / 1e9, fwd_bwd_gflop_s=3 * hand / train_s / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--text-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dit_forward.json"))
    args = parser.parse_args()
    rows = [bench(p, args.batch, args.text_len, args.repeats) for p in args.presets.split(",")]

    header = f"{'preset':8s} {'params':>8s} {'B':>3s} {'tok':>4s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'GFLOP fwd':>10s} {'(XLA)':>8s} {'fwd GFLOP/s':>12s} {'f+b GFLOP/s':>12s}"
    print(header)
    for r in rows:
        print(f"{r['preset']:8s} {r['params'] / 1e6:7.2f}M {r['batch']:3d} {r['tokens']:4d} {r['forward_ms']:8.2f} {r['fwd_bwd_ms']:11.2f} "
              f"{r['forward_gflops']:10.3f} {r['xla_forward_gflops']:8.3f} {r['forward_gflop_s']:12.1f} {r['fwd_bwd_gflop_s']:12.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    from machine import describe  # benchmarks/machine.py (this script's folder)
    env = describe(jax=jax.__version__, backend=jax.default_backend(), devices=jax.device_count())
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
