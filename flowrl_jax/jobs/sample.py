"""The `sample` job: PNGs of prompts from a train run's policy, its base, or a LoRA trained elsewhere, in any world.

    python -m flowrl_jax.main --config configs/<the run's config>.py --config.job=sample --workdir <the run's workdir> \\
        --config.sample.prompt="a photo of a cat"        # or --config.sample.prompts=prompts.txt (one per line) / .jsonl

Which weights: `config.policy` (`rl/trained.py`: the newest checkpoint or `policy.step`, EMA or not, or `policy.lora`;
the base when the workdir has no checkpoint). Writes `<out>/<index>.png` with `<index>.json` beside it (prompt, seed,
the sampler's settings, the weights) and `grid.png`; `out` is `sample.out`, else `<workdir>/samples/<weights>`.
Each image's initial noise comes from its own seed, `sample.seed + index`: with the ODE sampler the same seed, prompt and
settings give the same image whatever the batch. `sample.kind` "ode" (Euler) or a stochastic kernel ("sde", "cps", "lc"
at `sample.noise_level`; their step noise is drawn per batch from `sample.seed`). The sampler's steps, CFG and shift
default to the run's eval settings (`config.eval`). Every batch is split over the mesh's batch axes.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from PIL import Image
from tqdm import tqdm

from flowrl_jax import metrics, parallel
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.data import datasets
from flowrl_jax.rl import trained
from flowrl_jax.sampling import kernels, rollout, schedule


def settings(config) -> dict:
    """The sampler's settings, `config.eval`'s where `config.sample` leaves them unset."""
    s, e = config.sample, config.eval
    if s.kind not in kernels.KINDS:
        raise ConfigError(f"sample.kind={s.kind!r}: choose one of {', '.join(kernels.KINDS)}")
    return {"kind": s.kind, "num_steps": s.num_steps or e.num_steps, "cfg": s.cfg if s.cfg >= 0 else e.cfg,
            "shift": s.shift or e.shift, "grid": config.sampler.grid, "noise_level": s.noise_level if s.kind != "ode" else 0.0}


def prompt_rows(s) -> list[dict]:
    """The rows to sample: `sample.prompt`, or the rows of the `sample.prompts` file (txt: one per line; jsonl)."""
    if bool(s.prompt) == bool(s.prompts):
        raise ConfigError("give one of --config.sample.prompt='a photo of a cat' or --config.sample.prompts=prompts.txt (.txt / .jsonl)")
    if s.prompt:
        return [{"prompt": s.prompt}]
    try:
        return datasets.read_source(s.prompts)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"config.sample.prompts: {e}") from None


def make_sampler(world, dit, st: dict, rows):
    """`(dit_params, frozen, ids, mask, noise [B, ...], key) -> images [B, H, W, 3]`, jitted, batch-sharded (`rows`)."""
    sigmas = schedule.sigmas(st["num_steps"], st["shift"], st["grid"])

    def sample(params, frozen, ids, mask, noise, key):
        cond, null = world.encode(frozen, ids, mask), world.null_condition(frozen, ids.shape[0])
        velocity = rollout.guided(lambda x, sigma, c: dit.apply({"params": params}, x, sigma, *c), cond, null, st["cfg"])
        if st["kind"] == "ode":
            x = rollout.sample(velocity, noise, sigmas)
        else:
            levels = rollout.noise_levels(st["num_steps"], st["noise_level"])
            x = rollout.rollout(velocity, noise, sigmas, levels, key, st["kind"], dit.token_patch).final
        return world.decode(frozen, x)

    return jax.jit(sample, out_shardings=rows)


def run(config, workdir: str | None) -> dict:
    s = config.sample
    st, rows = settings(config), prompt_rows(s)
    run_ = trained.load(config, workdir)
    world, mesh = run_.world, run_.mesh
    shards = parallel.batch_shards(mesh)
    batch = -(-s.batch_size // shards) * shards  # a multiple of the batch shards: every device its own rows
    local = parallel.process_batch_slice(batch)
    frozen = run_.place(run_.base)
    params = run_.placed_dit_params(frozen["dit"])
    sharding = parallel.batch_sharding(mesh)
    sampler = make_sampler(world, run_.dit, st, sharding)
    items = [(row, s.seed + i) for i, row in enumerate(r for r in rows for _ in range(s.samples_per_prompt))]
    out = trained.output_folder("sample.out", s.out, workdir, "samples", run_.tag)
    shape = world.latent_shape(1)[1:]
    noise_of = jax.jit(lambda seeds: jax.vmap(lambda k: jax.random.normal(jax.random.PRNGKey(k), shape))(seeds), out_shardings=sharding)
    images_all = []
    print(f"sampling {len(items)} images of {len(rows)} prompts from {run_.source} ({st['kind']}, {st['num_steps']} steps, "
          f"cfg {st['cfg']}, shift {st['shift']}) -> {out}")
    for b, start in enumerate(tqdm(range(0, len(items), batch), desc="sample", disable=not metrics.is_writer())):
        chunk = items[start : start + batch]
        padded = chunk + [chunk[-1]] * (batch - len(chunk))  # one compiled shape; the copies are dropped
        ids, mask = world.tokenize([row for row, _ in padded[local]])  # this process's rows of the global batch
        ids, mask = parallel.shard_batch((np.asarray(ids), np.asarray(mask)), mesh)
        noise = noise_of(np.asarray([seed for _, seed in padded], np.uint32))  # host values: the same on every process
        images = parallel.to_host(sampler(params, frozen, ids, mask, noise, jax.random.fold_in(jax.random.PRNGKey(s.seed), b)))
        images_all.extend(images[: len(chunk)])
    if metrics.is_writer():
        write(out, items, np.stack(images_all), {**st, "samples_per_prompt": s.samples_per_prompt, "weights": run_.source})
    return {"out": out, "images": len(items), "source": run_.source}


def write(out: str, items: list, images: np.ndarray, settings_: dict) -> None:
    """`<index>.png` + `<index>.json` per image, and grid.png (the first 64, captioned with their prompts)."""
    os.makedirs(out, exist_ok=True)
    for i, ((row, seed), image) in enumerate(zip(items, metrics.to_uint8(images))):
        Image.fromarray(image).save(os.path.join(out, f"{i:05d}.png"))
        with open(os.path.join(out, f"{i:05d}.json"), "w") as f:
            json.dump({"prompt": row["prompt"], "seed": seed, "row": row, **settings_}, f, indent=2)
    metrics.save_grid(images[:64], os.path.join(out, "grid.png"), labels=[row["prompt"] for row, _ in items[:64]],
                      scale=max(1, 128 // images.shape[1]))
    print(f"wrote {len(items)} images and grid.png to {out}")
