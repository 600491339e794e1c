"""Compiled peak memory of one reward-gradient update against the number of sampler steps T: LeapAlign
against full backpropagation through the ODE trajectory, with and without `jax.checkpoint`.

    python benchmarks/memory.py [--preset shapes32] [--batch 8] [--steps 10,20,40]

Each variant is `jax.grad` w.r.t. the DiT params of `-sum R(x_0)` through the shipped learned reward
(`shapes32_reward`), jitted and compiled for a batch of `--batch` 32x32 images; the figure is XLA's
`memory_analysis().temp_size_in_bytes` (the buffers the computation allocates beyond its arguments
and outputs), no execution needed. LeapAlign (`objectives/leap.py`) takes the trajectory as an input
(states `[B, T, H, W, C]`, sampled without gradient) and backpropagates through two velocity calls;
full backprop runs the T Euler steps of `x_T -> x_0` under the gradient (a `lax.scan`, which keeps
every step's activations); `+ checkpoint` rematerializes each step in the backward pass (keeps only
each step's input). Prints a table and writes benchmarks/results/memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp

from flowrl_jax.rl.policy import PolicyFns
from configs.common import model_config
from flowrl_jax.models import build_mmdit
from flowrl_jax.objectives import leap
from flowrl_jax.objectives.batch import ParamTrees
from flowrl_jax.worlds.shapes import learned
from flowrl_jax.sampling import schedule


def measure(preset: str, batch: int, num_steps: int) -> dict:
    model = build_mmdit(model_config(preset))
    x, t, txt, pooled = model.dummy_inputs(batch, 8)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, t, txt, pooled)["params"])
    reward_apply, reward_params, tokenize = learned.reward_model()
    ids, mask = tokenize([{"prompt": "a red circle"}] * batch)
    sigmas = schedule.sigmas(num_steps, 1.0)

    def velocity(p, x, sigma, mb=None):
        return model.apply({"params": p}, x, sigma, txt, pooled)

    def reward(params, images, mb=None):
        return reward_apply(params, images, ids, mask)

    def leap_grad(p, states, x0, i_k, i_j):
        rows = jnp.arange(batch)
        mb = {"x_k": states[rows, i_k], "x_j": states[rows, i_j], "x0": x0, "sigma_k": sigmas[i_k], "sigma_j": sigmas[i_j],
              "weight": jnp.ones(batch)}
        fns, options = PolicyFns(None, velocity, reward), {**leap.DEFAULTS, "gamma": 0.5, "tau": 0.01}
        return jax.grad(lambda q: leap.loss(ParamTrees(q, None, reward=reward_params), mb, fns, options)[0])(p)

    def full_grad(p, x_T, remat: bool):
        def loss(q):
            def step(x, pair):
                return x + (pair[1] - pair[0]) * velocity(q, x, jnp.full((batch,), pair[0])), None

            step_fn = jax.checkpoint(step) if remat else step
            return -reward(reward_params, jax.lax.scan(step_fn, x_T, (sigmas[:-1], sigmas[1:]))[0]).sum()
        return jax.grad(loss)(p)

    spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    idx = jax.ShapeDtypeStruct((batch,), jnp.int32)
    temp = lambda fn, *args: jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    return {"steps": num_steps,
            "leapalign": temp(leap_grad, params, spec((batch, num_steps) + x.shape[1:]), spec(x.shape), idx, idx),
            "full_backprop": temp(lambda p, xT: full_grad(p, xT, False), params, spec(x.shape)),
            "full_backprop_checkpoint": temp(lambda p, xT: full_grad(p, xT, True), params, spec(x.shape))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="shapes32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", default="10,20,40")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    rows = [measure(args.preset, args.batch, int(t)) for t in args.steps.split(",")]
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"peak temp memory of one reward-gradient update ({args.preset}, batch {args.batch}), MiB")
    print(f"{'T':>4s} {'LeapAlign':>10s} {'full backprop':>14s} {'+ checkpoint':>13s}")
    for r in rows:
        print(f"{r['steps']:4d} {mib(r['leapalign']):10.1f} {mib(r['full_backprop']):14.1f} {mib(r['full_backprop_checkpoint']):13.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump({"args": vars(args), "platform": platform.platform(), "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
