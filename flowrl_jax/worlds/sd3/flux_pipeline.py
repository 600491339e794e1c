"""A diffusers FLUX.1 pipeline folder in JAX: CLIP-L (pooled), T5, the FLUX transformer and the VAE, without torch.

    pipe, params = load_flux_pipeline("path/to/FLUX.1-dev")  # params {"dit", "text": {"clip_l", "t5"}, "vae"} (host)
    ids = pipe.tokenize(["a photo of a cat"])                # [B, Lc + Lt] int32: CLIP's ids then T5's
    text_tokens, pooled = pipe.encode(params["text"], ids)   # [B, Lt, joint_attention_dim], [B, pooled_projection_dim]
    latents = pipe.sample(params, ids, noise, num_steps=28, cfg=1.0)   # noise, latents [B, h, w, 16] (NHWC)
    images = pipe.decode(params["vae"], latents)             # [B, 8h, 8w, 3] in [-1, 1]

The folder is what `FluxPipeline.save_pretrained` writes (FLUX.1-dev and FLUX.1-schnell alike). `encode` is diffusers'
`FluxPipeline.encode_prompt` (docs/real_models.md "FLUX.1"): the pooled output of CLIP-L (`CLIPTextModel`, unprojected)
and T5's last hidden states at `t5_max_length` tokens (512), no attention mask. The DiT is `flux.FluxLatents`: it
packs the latents, builds the rotary tables and feeds the distilled guidance (`guidance_scale`, FLUX.1-dev's 3.5), so
the loop sees it as it sees the MMDiT. No true CFG: a guidance-distilled model samples at `cfg=1`. The schedule is the
"flux" grid (`schedule.sigmas`) shifted by `e^mu`, mu from the image's token count as the folder's scheduler config
sets it (`default_shift`); the VAE's shift and scale factors come from its config (0.1159, 0.3611).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from flowrl_jax.models import clip_text, convert, t5 as t5_lib, vae as vae_lib
from flowrl_jax.models.flux import FluxLatents
from flowrl_jax.sampling import schedule
from flowrl_jax.worlds.sd3.pipeline import LatentPipeline, _component, _load, _tokenizer, check_family

MU_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}  # FLUX.1's scheduler


@dataclasses.dataclass(frozen=True, eq=False)
class FluxPipeline(LatentPipeline):
    dit: FluxLatents
    clip_l: Any
    t5: Any
    vae: Any
    tokenizers: tuple      # (CLIP-L, T5): transformers tokenizers from the folder (None: zeros, `build_flux_pipeline`)
    mu: dict = dataclasses.field(default_factory=lambda: dict(MU_DEFAULTS))  # the scheduler's dynamic-shift settings
    clip_max_length: int = 77
    t5_max_length: int = 512

    grid = "flux"

    @property
    def lengths(self) -> tuple[int, int]:
        return self.clip_max_length, self.t5_max_length

    def encode(self, text_params: dict, ids: jax.Array):
        """ids [B, Lc + Lt] -> (text_tokens [B, Lt, joint_attention_dim], pooled [B, P]) (diffusers `encode_prompt`)."""
        lc = self.clip_max_length
        _, pooled = self.clip_l.apply({"params": text_params["clip_l"]}, ids[:, :lc], hidden_layer=None)
        tokens = self.t5.apply({"params": text_params["t5"]}, ids[:, lc:])
        return tokens.astype(jnp.float32), pooled.astype(jnp.float32)

    def default_shift(self, latent_shape) -> float:
        """e^mu for latents [B, h, w, C]: `FluxPipeline.calculate_shift` of the packed token count (h / 2)(w / 2)."""
        m = self.mu
        tokens = (latent_shape[1] // 2) * (latent_shape[2] // 2)
        return math.exp(schedule.flux_mu(tokens, m["base_image_seq_len"], m["max_image_seq_len"], m["base_shift"], m["max_shift"]))


def _mu_settings(folder: str) -> dict:
    path = os.path.join(folder, "scheduler", "scheduler_config.json")
    if not os.path.isfile(path):
        return dict(MU_DEFAULTS)
    with open(path) as f:
        config = json.load(f)
    if not config.get("use_dynamic_shifting", True) or config.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"{path}: FLUX's sampler follows an exponential dynamic shift (use_dynamic_shifting=true, "
                         f"time_shift_type='exponential'); this scheduler config sets {config.get('use_dynamic_shifting')!r}, "
                         f"{config.get('time_shift_type')!r}")
    return {k: config.get(k, v) for k, v in MU_DEFAULTS.items()}


def load_flux_pipeline(folder: str, dtype=jnp.float32, param_dtype=jnp.float32, clip_max_length: int = 77,
                       t5_max_length: int = 512, remat: bool = False, attention: str = "xla", scan_blocks: str = "auto",
                       guidance_scale: float = 3.5, lora_alpha: float = 64.0) -> tuple[FluxPipeline, dict]:
    """A diffusers FLUX.1 folder -> (FluxPipeline, {"dit", "text": {"clip_l", "t5"}, "vae"}) on the host;
    `guidance_scale`: the distilled guidance fed to FLUX.1-dev (ignored by a model without the embedding, schnell).

    A missing component is a FileNotFoundError naming it; an SD3 folder is a ValueError saying so; an unknown key, a
    missing key or a shape mismatch is a ConversionError naming the component's folder and the keys."""
    check_family(folder, "FluxPipeline")
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    comp = lambda name: _component(folder, name, what="FLUX")  # noqa: E731
    dit, dit_params = _load(convert.load_flux, comp("transformer"), cls=FluxLatents, remat=remat, attention=attention,
                            scan_blocks=scan_blocks, guidance_scale=guidance_scale, lora_alpha=lora_alpha, **kw)
    clip_l, clip_params = _load(clip_text.load, comp("text_encoder"), **kw)
    t5, t5_params = _load(t5_lib.load, comp("text_encoder_2"), **kw)
    vae, vae_params = _load(vae_lib.load, comp("vae"), **kw)
    tokenizers = (_tokenizer(comp("tokenizer")), _tokenizer(comp("tokenizer_2")))
    pipe = FluxPipeline(dit, clip_l, t5, vae, tokenizers, _mu_settings(folder), clip_max_length, t5_max_length)
    return pipe, {"dit": dit_params, "text": {"clip_l": clip_params, "t5": t5_params}, "vae": vae_params}


# FLUX.1-dev's components as their config.json files set them (the fields that fix the shapes): the abstract pipeline
# of the memory plan, built without weights.
FLUX1_DEV = {
    "clip_l": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, eos_token_id=2,
                   projection=False),
    "t5": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
    "vae": dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
    "dit": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
}


def build_flux_pipeline(components: dict = FLUX1_DEV, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat: bool = False,
                        attention: str = "xla", scan_blocks: str = "auto", clip_max_length: int = 77, t5_max_length: int = 512,
                        guidance_scale: float = 3.5):
    """(FluxPipeline without tokenizers, `init(rng) -> params`) for `components` (default FLUX.1-dev): random weights,
    or their shapes alone (`abstract_flux_pipeline`). Without tokenizers, `tokenize` gives zeros of the right shape."""
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    dit = FluxLatents(**components["dit"], remat=remat, attention=attention, scan_blocks=scan_blocks, guidance_scale=guidance_scale, **kw)
    clip_l = clip_text.CLIPTextEncoder(**components["clip_l"], **kw)
    t5 = t5_lib.T5Encoder(**components["t5"], **kw)
    vae = vae_lib.AutoencoderKL(**components["vae"], **kw)
    pipe = FluxPipeline(dit, clip_l, t5, vae, (None, None), dict(MU_DEFAULTS), clip_max_length, t5_max_length)

    def init(rng) -> dict:
        keys = jax.random.split(rng, 4)
        return {"dit": dit.init(keys[0], *dit.dummy_inputs())["params"],
                "text": {"clip_l": clip_l.init(keys[1], jnp.zeros((1, clip_max_length), jnp.int32))["params"],
                         "t5": t5.init(keys[2], jnp.zeros((1, t5_max_length), jnp.int32))["params"]},
                "vae": vae.init(keys[3], jnp.zeros((1, 16, 16, 3)))["params"]}

    return pipe, init


def abstract_flux_pipeline(components: dict = FLUX1_DEV, **kwargs) -> tuple[FluxPipeline, dict]:
    """(FluxPipeline, its params as `jax.ShapeDtypeStruct`s): what compiling the pipeline's functions needs, no weights."""
    pipe, init = build_flux_pipeline(components, **kwargs)
    return pipe, jax.eval_shape(init, jax.random.PRNGKey(0))
