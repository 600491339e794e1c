"""The text-to-image pipeline of the embedded world: tokenizer -> text encoder -> MMDiT -> sampler.

    pipe = build_pipeline(config)                                # config.model (the DiT), config.text; a new tokenizer
    params = init_params(pipe, rng)                              # {"dit", "text"}
    ids, mask = pipe.tokenize(["a red circle", ""])              # host, numpy
    images = pipe.sample(params, ids, mask, rng, num_steps=20, cfg=4.0, shift=1.0)   # pure, jit it

`params = {"dit": ..., "text": ...}`. Images are [B, H, W, C] in [-1, 1] (pixel space: the shapes
world needs no VAE). The empty prompt is the CFG null condition.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.data import shapes
from flowrl_jax.models import build_mmdit, text as text_lib
from flowrl_jax.models.mmdit import MMDiT
from flowrl_jax.sampling import rollout, schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    dit: MMDiT
    text: text_lib.TextEncoder
    tokenizer: Any

    def tokenize(self, prompts) -> tuple[np.ndarray, np.ndarray]:
        return text_lib.tokenize(self.tokenizer, list(prompts), self.text.max_len)

    def encode(self, text_params, ids, mask):
        """-> (text_tokens [B, L, J], pooled [B, P])."""
        return self.text.apply({"params": text_params}, ids, mask)

    def velocity_fn(self, dit_params):
        """`(x, sigma, (text_tokens, pooled)) -> v`, the form `sampling.rollout.guided` takes."""
        return lambda x, sigma, cond: self.dit.apply({"params": dit_params}, x, sigma, *cond)

    def image_shape(self, batch: int) -> tuple[int, int, int, int]:
        s = self.dit.sample_size
        return (batch, s, s, self.dit.in_channels)

    def null_condition(self, text_params, batch: int):
        """The empty prompt's (text_tokens, pooled), broadcast to `batch` rows: the CFG null condition."""
        null_ids, null_mask = self.tokenize([""])
        null = self.encode(text_params, jnp.asarray(null_ids), jnp.asarray(null_mask))
        return jax.tree_util.tree_map(lambda u: jnp.broadcast_to(u, (batch,) + u.shape[1:]), null)

    def sample(self, params, ids, mask, rng, num_steps: int = 20, cfg: float = 4.0, shift: float = 1.0):
        """Euler ODE samples for the prompts `ids, mask` from noise drawn with `rng`."""
        cond = self.encode(params["text"], ids, mask)
        velocity = rollout.guided(self.velocity_fn(params["dit"]), cond, self.null_condition(params["text"], ids.shape[0]), cfg)
        x_T = jax.random.normal(rng, self.image_shape(ids.shape[0]))
        return rollout.sample(velocity, x_T, schedule.sigmas(num_steps, shift))


def world_vocabulary() -> list[str]:
    """Every word of the train and test prompt sets (the grammar's whole vocabulary)."""
    return sorted({w for split in ("train", "test") for p in shapes.load_prompts(split) for w in p["prompt"].lower().split()})


def build_pipeline(config, tokenizer=None) -> Pipeline:
    """Pipeline from `config.model` (the DiT) and `config.text` (the encoder's width/depth)."""
    tokenizer = tokenizer or text_lib.build_tokenizer(world_vocabulary())
    dit = build_mmdit(config.model)
    text = text_lib.TextEncoder(vocab_size=len(tokenizer), out_dim=dit.joint_attention_dim, pooled_dim=dit.pooled_projection_dim,
                                **dict(config.text))
    return Pipeline(dit, text, tokenizer)


def model_description(config) -> dict:
    """What `assets.load_pipeline` needs to rebuild the pipeline: written as model.json."""
    return {"model": config.model.to_dict(), "text": config.text.to_dict()}


def init_params(pipe: Pipeline, rng) -> dict:
    k_dit, k_text = jax.random.split(rng)
    ids, mask = (jnp.asarray(a) for a in pipe.tokenize([""]))
    text_params = pipe.text.init(k_text, ids, mask)["params"]
    x, t, _, _ = pipe.dit.dummy_inputs()
    return {"dit": pipe.dit.init(k_dit, x, t, *pipe.encode(text_params, ids, mask))["params"], "text": text_params}
