"""The latent world: a diffusers SD3 / SD3.5 pipeline folder (CLIP-L/G + T5, MMDiT, 16-channel VAE) in JAX.

    config.world = worlds.config_fields("sd3")        # pipeline folder, prompt datasets, resolution, ...
    world = SD3World(config.world, config.eval, facts)   # facts: worlds.RunFacts (seed, rewards, mesh, placement)

prompts -> the three tokenizers (host) -> `encode` (jit: diffusers' `encode_prompt`) -> the DiT's rollout in
latent space -> `decode` (the VAE) -> rewards on images -> eval on the held-out prompts. The pipeline itself
(encode_prompt, the sampler, loading a diffusers folder) is `pipeline.py`. Prompt sets are
ArrayRecord datasets written by `python -m flowrl_jax.data.datasets` (a folder + split) or, for small sets,
the source file itself (JSONL or one prompt per line). The train prompts are read per process by a grain
`PromptReader` (`data/datasets.py`): each process gets its own `prompts_per_iteration / process_count`
prompts, and the reader's position is saved in the checkpoint so a resumed run continues the same order.
Rewards are `rewards.REWARDS` by name (image rewards: any world's), the run's `facts.rewards`. The text
encoders and the VAE are frozen (`frozen = {"dit", "text", "vae"}`).

Text encoding, a config choice (`world.text_cache`): on the fly (False: `frozen["text"]` holds CLIP-L/G and
T5, every rollout encodes its rows), or cached (True: every train and test prompt and the empty one are
encoded once at load, `frozen["text"]` becomes that table {"tokens" [N, L, D], "pooled" [N, P]}, the ids are
row numbers [B, 1] and `encode` is a gather). The cache trades the encoders' memory (T5-XXL alone is 4.76B
parameters, 9.5 GB in bf16) and their per-iteration FLOPs for N x (Lc + Lt) x D values: 1.7 MB per prompt at
SD3.5's D = 4096, Lc = 77, Lt = 128 in bf16 (WORKSPACE_NOTES.md has the measured figures).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from flowrl_jax import metrics, parallel, rewards
from flowrl_jax.data import datasets
from flowrl_jax.rewards import device
from flowrl_jax.worlds.protocol import Evaluation, RewardModel, RunFacts
from flowrl_jax.worlds.sd3.flux_pipeline import load_flux_pipeline
from flowrl_jax.worlds.sd3.pipeline import load_sd3_pipeline

DEFAULTS = {
    "pipeline": "",          # a diffusers StableDiffusion3Pipeline folder (required)
    "train_prompts": "",     # an ArrayRecord dataset folder (split "train"), an .array_record, a .jsonl or a .txt (required)
    "test_prompts": "",      # the same for the eval set (split "test"); "" = no eval
    "resolution": 512,       # pixels; latents are resolution / 8
    "clip_max_length": 77,   # CLIP tokens (diffusers: the tokenizer's model_max_length, 77)
    "t5_max_length": 256,    # T5 tokens (diffusers' default 256; flow_grpo uses 128)
    "text_cache": False,     # encode every train/test prompt once at load and drop the text encoders (module doc)
    "dtype": "float32",      # compute dtype of every component ("bfloat16" on TPU / GPU)
    "param_dtype": "float32",
    "remat": False,          # rematerialize each MMDiT block in the backward pass (the memory plan, README)
    "scan_blocks": "auto",   # the MMDiT's runs of equal blocks as one lax.scan: "auto", "always", "never" (models/mmdit.py)
    "attention": "xla",      # "xla"; "cudnn" (GPU flash attention); "splash" (TPU Pallas): models/attention.py
    "lora_alpha": 64.0,      # LoRA's scale is lora_alpha / train.lora_rank (flow_grpo's SD3: 64 / 32)
    "reward_models": dict(device.FOLDERS),  # the device rewards' weights (pickscore, clipscore, aesthetic): rewards/device.py
}


def prompt_set(path: str, split: str) -> datasets.PromptDataset:
    """An ArrayRecord folder/file, or a JSONL / text source read in memory, as a random-access prompt set."""
    if path.endswith((".jsonl", ".txt")):
        return datasets.PromptDataset(datasets.read_source(path))
    return datasets.PromptDataset(path, split)


class SD3World:
    eval_name, eval_rows = "Reward on the test prompts", "prompts"
    eval_curves = {"eval/reward": "eval reward (test prompts)"}

    @staticmethod
    def check(settings) -> None:
        """The settings a run needs, checked without reading a file (ValueError naming the field)."""
        for field in ("pipeline", "train_prompts"):
            if not settings[field]:
                raise ValueError(f"config.world.{field} is required for the {settings.get('name', 'sd3')} world: pass --config.world.{field}=...")

    def __init__(self, settings, eval_settings, facts: RunFacts):
        w = settings
        self.check(settings)
        shards = parallel.batch_shards(facts.mesh)
        if w.test_prompts and eval_settings.batch_size % shards:
            raise ValueError(f"eval.batch_size={eval_settings.batch_size} must be a multiple of the {shards} batch shards of the mesh "
                             f"(config.mesh): each eval batch is split over them; e.g. --config.eval.batch_size="
                             f"{-(-eval_settings.batch_size // shards) * shards}")
        if not os.path.isdir(w.pipeline):
            raise FileNotFoundError(f"config.world.pipeline: folder {w.pipeline} not found (a diffusers SD3 pipeline folder)")
        test = prompt_set(w.test_prompts, "test") if w.test_prompts else []
        self._set_fields(settings, eval_settings, facts, prompt_set(w.train_prompts, "train"), [test[i] for i in range(len(test))], pipe=None)

    @classmethod
    def around(cls, settings, eval_settings, facts: RunFacts, pipe) -> "SD3World":
        """A world around an already built pipeline, with no prompt sets or folders: what compiling the train job's
        functions from abstract shapes needs (`benchmarks/memory_plan.py`)."""
        world = cls.__new__(cls)
        world._set_fields(settings, eval_settings, facts, [], [], pipe)
        return world

    def _set_fields(self, settings, eval_settings, facts: RunFacts, train_prompts, test_prompts: list, pipe) -> None:
        self.world_cfg, self.eval_cfg, self.facts = settings, eval_settings, facts
        self._rows = parallel.batch_sharding(facts.mesh)
        self.train_prompts, self.test_prompts = train_prompts, test_prompts
        self.pipe, self._sampler, self._noise, self._reward_fn, self.reader = pipe, None, None, None, None

    # ------------------------------------------------------------------------------------------ model
    def load(self):
        w = self.world_cfg
        self.pipe, params = self.load_pipeline(w.pipeline, dtype=jnp.dtype(w.dtype), param_dtype=jnp.dtype(w.param_dtype),
                                               clip_max_length=w.clip_max_length, t5_max_length=w.t5_max_length, remat=w.remat,
                                               attention=w.get("attention", "xla"), scan_blocks=w.get("scan_blocks", "auto"),
                                               lora_alpha=float(w.get("lora_alpha", 64.0)))
        self.latent_shape(1)  # the resolution fits the VAE and the patch size (ValueError otherwise)
        self._vae = params["vae"]  # host; the latent reward model decodes with it (`reward_model`)
        self._decode = jax.jit(self.decode_rows)  # called on the host's rollouts too (score): one program, not op by op
        if w.text_cache:
            params = {**params, "text": self._encode_all(self.place(params["text"]))}
        return self.pipe.dit, params

    def load_pipeline(self, folder: str, **kwargs):
        """(pipeline, host params) of the folder: `load_sd3_pipeline` (`FluxWorld`: `load_flux_pipeline`)."""
        return load_sd3_pipeline(folder, **kwargs)

    def place(self, host_params):
        """Host weights -> global arrays sharded by the run's partition rules, each device given only its own pieces
        (`facts.place`); the train job places the whole frozen tree the same way (`rl/state.py` `place_frozen`)."""
        return self.facts.place(host_params)

    def _encode_all(self, text_params, batch_size: int = 32) -> dict:
        """The text cache: every distinct train/test prompt and "" encoded once -> {"tokens", "pooled"} (host numpy);
        `text_params` are placed on the mesh already (`place`)."""
        rows = [self.train_prompts[i] for i in range(len(self.train_prompts))] + self.test_prompts
        prompts = sorted({r["prompt"] for r in rows} | {""})
        self._row_of = {p: i for i, p in enumerate(prompts)}
        encode = jax.jit(self.pipe.encode)
        tokens, pooled = [], []
        for start in tqdm(range(0, len(prompts), batch_size), desc="text cache", leave=False):
            chunk = prompts[start : start + batch_size]
            ids = self.pipe.tokenize(chunk + [""] * (batch_size - len(chunk)))  # one compiled shape
            t, p = encode(text_params, ids)
            tokens.append(parallel.to_host(t)[: len(chunk)])  # every process's host gets the whole table
            pooled.append(parallel.to_host(p)[: len(chunk)])
        dtype = jnp.dtype(self.world_cfg.dtype)
        return {"tokens": np.concatenate(tokens).astype(dtype), "pooled": np.concatenate(pooled).astype(dtype)}

    def tokenize(self, prompts):
        """-> ids, mask [B, Lc + Lc + Lt] (the three tokenizers' ids side by side), or with the text cache the
        prompts' rows [B, 1]. The mask is all ones: SD3 attends to every token, pads included (diffusers)."""
        texts = [p["prompt"] for p in prompts]
        if self.world_cfg.text_cache:
            missing = [t for t in texts if t not in self._row_of]
            if missing:
                raise ValueError(f"prompts not in the text cache (world.text_cache caches the train and test sets): {missing[:3]}")
            ids = np.asarray([[self._row_of[t]] for t in texts], np.int32)
        else:
            ids = self.pipe.tokenize(texts)
        return ids, np.ones(ids.shape, bool)

    def encode(self, frozen, ids, mask):
        """-> (text_tokens [B, Lc + Lt, D], pooled [B, P]) float32: the encoders, or the cache's rows."""
        text = frozen["text"]
        if self.world_cfg.text_cache:
            return jnp.take(text["tokens"], ids[:, 0], axis=0).astype(jnp.float32), jnp.take(text["pooled"], ids[:, 0], axis=0).astype(jnp.float32)
        return self.pipe.encode(text, ids)

    def null_condition(self, frozen, batch: int):
        """The empty prompt's conditioning, `batch` rows (diffusers' default negative prompt)."""
        null = self.encode(frozen, jnp.asarray(self.tokenize([{"prompt": ""}])[0]), None)
        return jax.tree_util.tree_map(lambda u: jnp.broadcast_to(u, (batch,) + u.shape[1:]), null)

    def latent_shape(self, batch: int):
        return self.pipe.latent_shape(batch, self.world_cfg.resolution)

    def decode(self, frozen, x):
        """latents [..., h, w, C] -> images [..., H, W, 3]: leading axes beyond the batch (stepwise credit's completions
        [B, m, ...]) are folded into it for the VAE."""
        lead = x.shape[:-3]
        images = self._decode(frozen["vae"], x.reshape((-1,) + x.shape[-3:]))
        return images.reshape(lead + images.shape[1:])

    def decode_rows(self, vae_params, x):
        """latents [B, h, w, C] -> images [B, H, W, 3], `facts.decode_chunk` rows at a time (`train.rollout_chunk`; all
        at once when 0): the VAE decoder's activations at 512 px are ~100x the latents', the memory plan's third knob."""
        chunk = self.facts.decode_chunk
        if not chunk or chunk >= x.shape[0]:
            return self.pipe.decode(vae_params, x)
        shards = parallel.batch_shards(self._rows.mesh)
        out = parallel.map_row_chunks(lambda i, c: self.pipe.decode(vae_params, c), x, x.shape[0] // chunk, shards, self._rows)
        return parallel.constrain_rows(out, self._rows, x.shape[0])

    # ---------------------------------------------------------------------------------------- prompts
    def sample_prompts(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(len(self.train_prompts), size=n)

    def prompt_reader(self, prompts_per_iteration: int) -> datasets.PromptReader:
        """This process's reader of `prompts_per_iteration / process_count` train prompts per iteration."""
        count = jax.process_count()
        if prompts_per_iteration % count:
            raise ValueError(f"train.prompts_per_iteration={prompts_per_iteration} must be divisible by the {count} processes")
        if self.reader is None:
            self.reader = datasets.PromptReader(self.train_prompts, prompts_per_iteration // count, self.facts.seed,
                                                jax.process_index(), count)
        return self.reader

    # ---------------------------------------------------------------------------------------- rewards
    def reward_fn(self, weighted, remote_settings=None):
        return rewards.build(weighted, self.world_cfg.reward_models, remote_settings)

    def reward_model(self) -> RewardModel:
        """The latent world's differentiable reward: `train.rewards`' weighted sum of device rewards on the VAE's decode,
        `apply(params, latents [B, h, w, C], ids, mask) -> [B]` (params {"vae", "rewards"}; each reward's token ids
        side by side in `ids`). Spatial credit and LeapAlign differentiate it; a host reward in the sum is an error."""
        weighted = [(str(n), float(w)) for n, w in self.facts.rewards]
        host = [n for n, _ in weighted if n not in device.FACTORIES]
        if host:
            raise ValueError(f"spatial credit and LeapAlign differentiate the reward, and {host} run on the host: in the sd3 "
                             f"world set --config.train.rewards to device rewards only ({', '.join(sorted(device.FACTORIES))})")
        built = device.load_all(weighted, self.world_cfg.reward_models)
        widths = [built[n].tokenize([{"prompt": ""}]).shape[1] for n, _ in weighted]
        starts = np.cumsum([0] + widths)

        def apply(p, latents, ids, mask):
            images = self.pipe.decode(p["vae"], latents)
            return sum(w * built[n].apply(p["rewards"][n], images, ids[:, a:b])
                       for (n, w), a, b in zip(weighted, starts[:-1], starts[1:]))

        def tokenize(rows):
            ids = np.concatenate([np.asarray(built[n].tokenize(rows)) for n, _ in weighted], axis=1).astype(np.int32)
            return ids, np.ones(ids.shape, bool)

        return RewardModel(apply, {"vae": self._vae, "rewards": {n: r.params for n, r in built.items()}}, tokenize)

    def eval_inputs(self, rows: list[dict], key) -> tuple[jax.Array, jax.Array]:
        """-> (ids, noise [B, h, w, C]) of one eval batch of `eval.batch_size` prompt rows (every process passes the same
        rows), both batch-sharded over the mesh's batch axes: each process tokenizes its own rows, and the noise is drawn
        from `key` where it lies (threefry draws the same values whatever the sharding)."""
        if self._noise is None:
            self._noise = jax.jit(lambda k: jax.random.normal(k, self.latent_shape(self.eval_cfg.batch_size)), out_shardings=self._rows)
        local = parallel.process_batch_slice(len(rows))
        ids = parallel.shard_batch(self.tokenize(rows[local])[0], self.facts.mesh)
        return ids, self._noise(key)

    def eval_batch(self, params: dict, ids, noise) -> jax.Array:
        """Images [B, H, W, 3] of one eval batch (`eval_sampler`); they stay batch-sharded."""
        return self.eval_sampler()(params, ids, noise)

    def eval_sampler(self):
        """The jitted eval program, `(params {"dit", "text", "vae"}, ids [B, L], noise [B, h, w, C]) -> images`: the ODE
        sampler (CFG `eval.cfg`, `eval.num_steps` at `eval.shift`) and the VAE decode (in `facts.decode_chunk` row chunks),
        every device on its own rows (`benchmarks/memory_plan.py` compiles it per memory plan)."""
        if self._sampler is None:
            e = self.eval_cfg

            def sample(p, ids, noise):
                cond, null = self.encode(p, ids, None), self.null_condition(p, ids.shape[0])
                latents = self.pipe.sample_from(p["dit"], cond, null, noise, e.num_steps, e.cfg, e.shift)
                return self.decode_rows(p["vae"], parallel.constrain_rows(latents, self._rows, ids.shape[0]))

            self._sampler = jax.jit(sample, out_shardings=self._rows)
        return self._sampler

    def evaluate(self, dit_params, frozen, step: int, workdir: str) -> Evaluation:
        """The train rewards of ODE samples on the test prompts, sharded over the mesh's batch axes (`eval_batch`); each
        process scores its own rows where the images lie (host rewards on its rows, device rewards on the device, a reward
        server sees each row once), and the scores are gathered for the table. Writes eval_<step>.png."""
        e = self.eval_cfg
        if not self.test_prompts:
            return Evaluation({"table": {}}, {}, "no test prompts (config.world.test_prompts)")
        if self._reward_fn is None:
            self._reward_fn = rewards.build(self.facts.rewards, self.world_cfg.reward_models, self.facts.remote_rewards)
        params = {"dit": dit_params, "text": frozen["text"], "vae": frozen["vae"]}
        rows = [p for p in self.test_prompts for _ in range(e.samples_per_prompt)]
        rng = jax.random.PRNGKey(e.noise_seed)  # the same noise at every eval
        local, mesh = parallel.process_batch_slice(e.batch_size), self.facts.mesh
        grid, totals, parts = [], [], {}
        for i, start in enumerate(tqdm(range(0, len(rows), e.batch_size), desc="eval", leave=False)):
            chunk = rows[start : start + e.batch_size]
            padded = chunk + [chunk[-1]] * (e.batch_size - len(chunk))  # one compiled shape; the copies are dropped below
            images = self.eval_batch(params, *self.eval_inputs(padded, jax.random.fold_in(rng, i)))
            if len(grid) < 16:
                grid.extend(parallel.to_host(images)[: min(len(chunk), 16 - len(grid))])
            failure = None
            try:  # a failure anywhere is raised everywhere, before the next collective
                total, named = self._reward_fn(images, padded[local])
            except Exception as err:
                failure = err
            rewards.agree_on_failure(failure)
            gather = lambda v: parallel.to_host(parallel.global_from_local(np.asarray(v, np.float32), mesh))[: len(chunk)]  # noqa: E731
            totals.append(gather(total))
            for n, v in named.items():
                parts.setdefault(n, []).append(gather(v))
        table = category_table(rows, np.concatenate(totals), {n: np.concatenate(v) for n, v in parts.items()})
        if jax.process_index() == 0:
            images = np.stack(grid)
            metrics.save_grid(images, os.path.join(workdir, f"eval_{step:06d}.png"), labels=[r["prompt"][:24] for r in rows[:16]],
                              scale=max(1, 96 // images.shape[1]))
        scalars = {f"eval/{k}": v for k, v in table["test"].items() if k != "n"}
        text = (f"eval at step {step} ({len(self.test_prompts)} test prompts x {e.samples_per_prompt}, ODE {e.num_steps} steps, "
                f"cfg {e.cfg}): " + ", ".join(f"{k} {v:.4f}" for k, v in table["test"].items() if k != "n"))
        return Evaluation({"table": table}, scalars, text)


def category_table(rows: list[dict], total: np.ndarray, parts: dict) -> dict:
    """{"test": every row's mean reward and reward parts, and "n"} plus one such row per category where the prompt rows
    carry one (GenEval's metadata "tag", or "category"), in order of first appearance."""
    def stats(index):
        return {"reward": float(np.mean(total[index])), **{n: float(np.mean(v[index])) for n, v in parts.items()}, "n": int(len(index))}

    table = {"test": stats(np.arange(len(rows)))}
    categories = [r.get("tag", r.get("category")) for r in rows]
    for c in dict.fromkeys(c for c in categories if c is not None):
        table[str(c)] = stats(np.asarray([i for i, x in enumerate(categories) if x == c]))
    return table


FLUX_DEFAULTS = {**DEFAULTS,
                 "pipeline": "",        # a diffusers FluxPipeline folder (FLUX.1-dev or -schnell; required)
                 "t5_max_length": 512,  # T5 tokens (FluxPipeline's max_sequence_length; flow_grpo trains at 128)
                 "lora_alpha": 128.0,   # flow_grpo's FLUX LoRA: rank 64, alpha 128
                 "guidance": 3.5}       # FLUX.1-dev's distilled guidance scale, fed to the transformer (schnell: ignored)


class FluxWorld(SD3World):
    """The latent world on a diffusers FLUX.1 folder (`flux_pipeline.py`): the same prompts, rewards, text cache, eval
    and sharding as SD3's; the pipeline differs (CLIP-L pooled + T5, `FluxLatents`, the "flux" sigma grid). FLUX.1 is
    guidance-distilled: no CFG (`sampler.cfg`, `eval.cfg` and any objective's `train_cfg` must be 1, or 0 where 0 means
    the sampler's), its guidance is `world.guidance`."""

    @staticmethod
    def check_run(config) -> None:
        """The run's settings a FLUX world cannot take (ValueError naming the key and the fix)."""
        s, e = config.sampler, config.eval
        if s.grid != "flux":
            raise ValueError(f"sampler.grid={s.grid!r}: FLUX samples on FluxPipeline's grid, set --config.sampler.grid=flux "
                             "(and sampler.shift / eval.shift to e^mu, schedule.flux_shift(resolution))")
        for key, value in (("sampler.cfg", s.cfg), ("eval.cfg", e.cfg)):
            if value != 1.0:
                raise ValueError(f"{key}={value}: FLUX.1 is guidance-distilled and has no classifier-free guidance; set "
                                 f"--config.{key}=1 (the distilled guidance scale is world.guidance={config.world.guidance})")
        options = config.objective.get(config.objective.name) or {}
        if options.get("train_cfg", 0.0) not in (0.0, 1.0):
            raise ValueError(f"objective.{config.objective.name}.train_cfg={options['train_cfg']}: FLUX.1 has no "
                             f"classifier-free guidance; set it to 0 (the sampler's, 1) or 1")

    def load_pipeline(self, folder: str, **kwargs):
        return load_flux_pipeline(folder, guidance_scale=float(self.world_cfg.guidance), **kwargs)
