"""Shapes-world evaluator: time per batch and the full validation against the renderer.

    python benchmarks/shapes_eval.py [--batch 1000] [--repeats 5] [--validate 5000]

Timing: `evaluator.evaluate` (detection, scoring and the per-image detection lists) on a batch of
rendered scenes, prompts cycling over all six categories, median of `--repeats` calls after a warm-up,
at 32x32 and 64x64, clean and with pixel noise of std `--noise` (like a model's samples: no background pixel). Validation: `evaluator.validate(--validate)` per category (strict accuracy on the
scene's own prompt, rejection of a near-miss prompt), clean and with pixel noise of std 0.1 (in [-1, 1]).
Writes benchmarks/results/shapes_eval.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from flowrl_jax.data import shapes
from flowrl_jax.worlds.shapes import evaluator


def time_evaluate(batch: int, size: int, repeats: int, noise: float = 0.0) -> dict:
    """Median seconds of `evaluate` on `batch` rendered scenes, plus Gaussian pixel noise of std `noise` (a model's
    samples have no pixel exactly of the background colour, which the evaluator otherwise skips)."""
    pool = [s for c in shapes.CATEGORIES for s in shapes.all_specs(c)]
    specs = [pool[i % len(pool)] for i in range(batch)]
    rng = np.random.default_rng(0)
    images = shapes.render_batch(specs, rng, size)
    images = images + noise * rng.standard_normal(images.shape).astype(np.float32)
    evaluator.evaluate(images, specs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = evaluator.evaluate(images, specs)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return dict(size=size, batch=batch, noise=noise, seconds=seconds, images_per_s=batch / seconds,
                strict_mean=float(out["strict"].mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--validate", type=int, default=5000, help="scenes per category")
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "shapes_eval.json"))
    args = parser.parse_args()

    timing = [time_evaluate(args.batch, size, args.repeats, noise) for noise in (0.0, args.noise) for size in (32, 64)]
    print(f"{'size':>5s} {'noise':>6s} {'batch':>6s} {'evaluate s':>11s} {'us/image':>9s} {'images/s':>9s} {'strict':>7s}")
    for r in timing:
        print(f"{r['size']:5d} {r['noise']:6.2f} {r['batch']:6d} {r['seconds']:11.3f} {1e6 * r['seconds'] / r['batch']:9.1f}"
              f" {r['images_per_s']:9.0f} {r['strict_mean']:7.3f}")

    t0 = time.perf_counter()
    clean = evaluator.validate(args.validate, seed=0)
    noisy = evaluator.validate(args.validate, seed=1, noise=args.noise)
    print(f"\nvalidation, {args.validate} scenes per category ({time.perf_counter() - t0:.1f} s); "
          f"near miss = one shape, color, count or relation changed")
    print(f"{'category':14s} {'accept':>8s} {'reject':>8s} {'score own':>10s} {'score miss':>11s}"
          f" {'accept@' + str(args.noise):>11s} {'reject@' + str(args.noise):>11s}")
    for cat in shapes.CATEGORIES:
        c, n = clean[cat], noisy[cat]
        print(f"{cat:14s} {c['accept']:8.4f} {c['reject']:8.4f} {c['score_own']:10.3f} {c['score_other']:11.3f}"
              f" {n['accept']:11.4f} {n['reject']:11.4f}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    from machine import describe  # benchmarks/machine.py (this script's folder)
    env = describe(numpy=np.__version__)
    with open(args.out, "w") as f:
        json.dump({"env": env, "timing": timing, "validation": clean, "validation_noise": noisy,
                   "noise_std": args.noise}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
