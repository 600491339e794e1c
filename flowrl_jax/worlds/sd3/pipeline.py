"""A diffusers SD3 / SD3.5 pipeline folder in JAX: CLIP-L, CLIP-G, T5, the MMDiT and the VAE, without torch.

    pipe, params = load_sd3_pipeline("path/to/stable-diffusion-3.5-medium")   # params {"dit", "text", "vae"} (host)
    ids = pipe.tokenize(["a photo of a cat", ""])            # [B, Lc + Lc + Lt] int32: the three tokenizers' ids side by side
    text_tokens, pooled = pipe.encode(params["text"], ids)   # [B, Lc + Lt, joint_attention_dim], [B, pooled_projection_dim]
    latents = pipe.sample(params, ids, noise, num_steps=28, cfg=7.0)   # noise, latents [B, h, w, 16] (NHWC)
    images = pipe.decode(params["vae"], latents)             # [B, 8h, 8w, 3] in [-1, 1]

The folder is what `StableDiffusion3Pipeline.save_pretrained` writes: `model_index.json`, `transformer/`,
`vae/`, `text_encoder{,_2,_3}/`, `tokenizer{,_2,_3}/`, `scheduler/` (weights single or sharded
safetensors, bf16 or fp32). `text_encoder_3` may be absent (SD3 without T5: its tokens are zeros, as
diffusers does). `encode` is diffusers' `encode_prompt` (docs/math.md's conditioning): the penultimate hidden
states of both CLIPs concatenated on features and zero-padded to T5's width, T5's sequence appended
along tokens; pooled = both CLIPs' projected EOS states concatenated. Like diffusers, no attention
mask is passed to any text encoder (pad tokens are attended). The scheduler's `shift` is read from
`scheduler/scheduler_config.json`; the sampler is `sampling.rollout.sample` on `schedule.sigmas`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models import clip_text, convert, t5 as t5_lib, vae as vae_lib
from flowrl_jax.models.mmdit import MMDiT
from flowrl_jax.models.presets import PRESETS
from flowrl_jax.sampling import rollout, schedule

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")  # text_encoder_3 / tokenizer_3: optional
FLUX_COMPONENTS = COMPONENTS


class LatentPipeline:
    """What an SD3 and a FLUX pipeline share once their text is encoded: the velocity, CFG's null condition, the
    latent shape, the VAE decode and the ODE sampler on the pipeline's sigma grid. A subclass holds `dit` (latents
    [B, h, w, C] in, velocity out), `vae`, `tokenizers` and their `lengths`, `grid` ("sd3" | "flux", `schedule.sigmas`),
    `encode`, and `default_shift(latent_shape)`: the shift its scheduler would use."""

    grid = "sd3"

    def tokenize(self, prompts) -> np.ndarray:
        """Host: prompts -> [B, sum(lengths)] int32, each tokenizer's ids side by side, padded to its max length and
        truncated as diffusers does (a missing tokenizer: zeros)."""
        prompts = list(prompts)
        parts = []
        for tokenizer, length in zip(self.tokenizers, self.lengths):
            if tokenizer is None:
                parts.append(np.zeros((len(prompts), length), np.int32))
                continue
            out = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, add_special_tokens=True)
            parts.append(np.asarray(out["input_ids"], np.int32))
        return np.concatenate(parts, axis=1)

    def velocity_fn(self, dit_params):
        """`(x, sigma, cond) -> v`, the form `sampling.rollout.guided` takes (cond: `encode`'s pytree)."""
        return lambda x, sigma, cond: self.dit.apply({"params": dit_params}, x, sigma, *cond)

    def null_condition(self, text_params: dict, batch: int):
        """The empty prompt's conditioning broadcast to `batch` rows: diffusers' default negative prompt."""
        null = self.encode(text_params, jnp.asarray(self.tokenize([""])))
        return jax.tree_util.tree_map(lambda u: jnp.broadcast_to(u, (batch,) + u.shape[1:]), null)

    def latent_shape(self, batch: int, resolution: int) -> tuple[int, int, int, int]:
        """[B, h, w, C] of `resolution`-pixel images (the VAE downsamples by 2^(levels - 1))."""
        factor = 2 ** (len(self.vae.block_out_channels) - 1)
        if resolution % (factor * self.dit.token_patch):
            raise ValueError(f"resolution {resolution} must be divisible by {factor * self.dit.token_patch} (VAE factor x the DiT's "
                             "latent pixels per token)")
        return (batch, resolution // factor, resolution // factor, self.vae.latent_channels)

    def decode(self, vae_params, latents: jax.Array) -> jax.Array:
        """latents [B, h, w, C] -> images [B, H, W, 3] in [-1, 1] (diffusers: `vae.decode(latents / scale + shift)`)."""
        z = vae_lib.from_dit_latents(self.vae, latents)
        return jnp.clip(self.vae.apply({"params": vae_params}, z, method="decode"), -1.0, 1.0)

    def sample(self, params: dict, ids: jax.Array, noise: jax.Array, num_steps: int = 28, cfg: float = 7.0, shift: float | None = None):
        """Euler ODE latents [B, h, w, C] from `noise` for the prompts `ids` (CFG against the empty prompt; cfg 1: none)."""
        cond, null = self.encode(params["text"], ids), self.null_condition(params["text"], ids.shape[0])
        return self.sample_from(params["dit"], cond, null, noise, num_steps, cfg, shift)

    def sample_from(self, dit_params, cond, null, noise: jax.Array, num_steps: int = 28, cfg: float = 7.0, shift: float | None = None):
        """`sample` from encoded conditionings (`encode`'s) and the null one; `shift` None: the scheduler's."""
        velocity = rollout.guided(self.velocity_fn(dit_params), cond, null, cfg)
        shift = self.default_shift(noise.shape) if shift is None else shift
        return rollout.sample(velocity, noise, schedule.sigmas(num_steps, shift, self.grid))


@dataclasses.dataclass(frozen=True, eq=False)
class SD3Pipeline(LatentPipeline):
    dit: MMDiT
    clip_l: Any
    clip_g: Any
    t5: Any                # None: SD3 without its T5 encoder
    vae: Any
    tokenizers: tuple      # (CLIP-L, CLIP-G, T5 or None): transformers tokenizers from the folder
    shift: float           # the scheduler's
    clip_max_length: int = 77
    t5_max_length: int = 256
    clip_skip: int | None = None

    @property
    def lengths(self) -> tuple[int, int, int]:
        return self.clip_max_length, self.clip_max_length, self.t5_max_length

    def encode(self, text_params: dict, ids: jax.Array):
        """ids [B, Lc + Lc + Lt] -> (text_tokens [B, Lc + Lt, joint_attention_dim], pooled [B, P]) (diffusers `encode_prompt`)."""
        lc, _, lt = self.lengths
        layer = -(self.clip_skip + 2) if self.clip_skip is not None else -2
        h_l, p_l = self.clip_l.apply({"params": text_params["clip_l"]}, ids[:, :lc], hidden_layer=layer)
        h_g, p_g = self.clip_g.apply({"params": text_params["clip_g"]}, ids[:, lc : 2 * lc], hidden_layer=layer)
        width = self.dit.joint_attention_dim
        if self.t5 is not None:
            t5_tokens = self.t5.apply({"params": text_params["t5"]}, ids[:, 2 * lc :])
        else:
            t5_tokens = jnp.zeros((ids.shape[0], lt, width), jnp.float32)
        clip = jnp.concatenate([h_l, h_g], axis=-1).astype(jnp.float32)
        if clip.shape[-1] > width:
            raise ValueError(f"CLIP widths {h_l.shape[-1]} + {h_g.shape[-1]} exceed the DiT's joint_attention_dim={width}")
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        return jnp.concatenate([clip, t5_tokens.astype(jnp.float32)], axis=1), jnp.concatenate([p_l, p_g], axis=-1).astype(jnp.float32)

    def default_shift(self, latent_shape) -> float:
        return self.shift


def _component(folder: str, name: str, required: bool = True, what: str = "SD3") -> str | None:
    path = os.path.join(folder, name)
    if os.path.isdir(path):
        return path
    if required:
        needs = (f"a diffusers StableDiffusion3Pipeline folder needs {', '.join(COMPONENTS)}; text_encoder_3/tokenizer_3 "
                 "are optional") if what == "SD3" else f"a diffusers FluxPipeline folder needs {', '.join(FLUX_COMPONENTS)}"
        raise FileNotFoundError(f"the {what} pipeline folder {folder} has no {name}/ ({needs})")
    return None


def _load(loader, path: str, **overrides):
    try:
        return loader(path, **overrides)
    except convert.ConversionError as e:
        raise convert.ConversionError(f"{path}: {e}") from None


def _tokenizer(path: str | None):
    if path is None:
        return None
    from transformers import AutoTokenizer  # host only; tokenizers from the folder's own files, no network
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


FAMILIES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}  # model_index.json's _class_name: the world's name


def check_family(folder: str, expected: str) -> None:
    """The folder's `model_index.json` names `expected` (or another class of the same world) or names none; otherwise a
    ValueError saying which world reads it (`config.world.name`)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"pipeline folder {folder} not found: point to a diffusers {expected} folder "
                                "(save_pretrained / a downloaded snapshot)")
    path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        found = json.load(f).get("_class_name")
    if found in FAMILIES and FAMILIES[found] != FAMILIES[expected]:
        raise ValueError(f"{folder} is a {found} folder (model_index.json), not a {expected} one: set "
                         f"--config.world.name={FAMILIES[found]}")


def _shift(folder: str) -> float:
    path = os.path.join(folder, "scheduler", "scheduler_config.json")
    if not os.path.isfile(path):
        return 3.0  # FlowMatchEulerDiscreteScheduler's SD3 setting
    with open(path) as f:
        return float(json.load(f).get("shift", 1.0))


def load_sd3_pipeline(folder: str, dtype=jnp.float32, param_dtype=jnp.float32, clip_max_length: int = 77,
                      t5_max_length: int = 256, remat: bool = False, attention: str = "xla",
                      scan_blocks: str = "auto", lora_alpha: float = 64.0) -> tuple[SD3Pipeline, dict]:
    """A diffusers SD3/SD3.5 folder -> (SD3Pipeline, {"dit", "text": {"clip_l", "clip_g"[, "t5"]}, "vae"}) on the host.

    A missing component is a FileNotFoundError naming it; an unknown key, a missing key or a shape mismatch
    is a ConversionError naming the component's folder and the keys."""
    check_family(folder, "StableDiffusion3Pipeline")
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    dit, dit_params = _load(convert.load_diffusers, _component(folder, "transformer"), remat=remat, attention=attention,
                            scan_blocks=scan_blocks, lora_alpha=lora_alpha, **kw)
    clip_l, clip_l_params = _load(clip_text.load, _component(folder, "text_encoder"), **kw)
    clip_g, clip_g_params = _load(clip_text.load, _component(folder, "text_encoder_2"), **kw)
    text = {"clip_l": clip_l_params, "clip_g": clip_g_params}
    t5_path = _component(folder, "text_encoder_3", required=False)
    t5 = None
    if t5_path is not None:
        t5, text["t5"] = _load(t5_lib.load, t5_path, **kw)
    vae, vae_params = _load(vae_lib.load, _component(folder, "vae"), **kw)
    tokenizers = (_tokenizer(_component(folder, "tokenizer")), _tokenizer(_component(folder, "tokenizer_2")),
                  _tokenizer(_component(folder, "tokenizer_3", required=t5 is not None)))
    pipe = SD3Pipeline(dit, clip_l, clip_g, t5, vae, tokenizers, _shift(folder), clip_max_length, t5_max_length)
    return pipe, {"dit": dit_params, "text": text, "vae": vae_params}


# SD3.5-Medium's components as their config.json files set them (the fields that fix the shapes): the abstract
# pipeline of the memory plan and the on-paper benchmarks, built without weights.
SD35_MEDIUM = {
    "clip_l": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, eos_token_id=2),
    "clip_g": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, projection_dim=1280, num_hidden_layers=32,
                   num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5, eos_token_id=2),
    "t5": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
    "vae": dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
                scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
    "dit": PRESETS["sd35_medium"],
}


def build_pipeline(components: dict = SD35_MEDIUM, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat: bool = False,
                   attention: str = "xla", scan_blocks: str = "auto",
                   clip_max_length: int = 77, t5_max_length: int = 256, shift: float = 3.0):
    """(SD3Pipeline without tokenizers, `init(rng) -> params`) for `components` (default SD3.5-M): random weights
    for throughput runs (`benchmarks/gpu_real_size.py`), or their shapes alone (`abstract_pipeline`). Without
    tokenizers, `tokenize` gives zeros of the right shape."""
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    dit = MMDiT(**components["dit"], remat=remat, attention=attention, scan_blocks=scan_blocks, **kw)
    clip_l, clip_g = (clip_text.CLIPTextEncoder(**components[k], **kw) for k in ("clip_l", "clip_g"))
    t5 = t5_lib.T5Encoder(**components["t5"], **kw)
    vae = vae_lib.AutoencoderKL(**components["vae"], **kw)
    pipe = SD3Pipeline(dit, clip_l, clip_g, t5, vae, (None, None, None), shift, clip_max_length, t5_max_length)

    def init(rng) -> dict:
        keys = jax.random.split(rng, 5)
        clip_ids, t5_ids = jnp.zeros((1, clip_max_length), jnp.int32), jnp.zeros((1, t5_max_length), jnp.int32)
        return {"dit": dit.init(keys[0], *dit.dummy_inputs(1, 1, 8, 8))["params"],
                "text": {"clip_l": clip_l.init(keys[1], clip_ids)["params"], "clip_g": clip_g.init(keys[2], clip_ids)["params"],
                         "t5": t5.init(keys[3], t5_ids)["params"]},
                "vae": vae.init(keys[4], jnp.zeros((1, 16, 16, 3)))["params"]}

    return pipe, init


def abstract_pipeline(components: dict = SD35_MEDIUM, **kwargs) -> tuple[SD3Pipeline, dict]:
    """(SD3Pipeline, its params as `jax.ShapeDtypeStruct`s): what `jax.jit(...).lower` needs to compile the
    pipeline's functions, no weights (`build_pipeline`'s keyword arguments)."""
    pipe, init = build_pipeline(components, **kwargs)
    return pipe, jax.eval_shape(init, jax.random.PRNGKey(0))
