"""FLUX.1 transformer in Flax linen, a pure-functional port of diffusers' `FluxTransformer2DModel`.

    tokens = pack(latents)                                                            # [B, H, W, 16] -> [B, N, 64]
    rope = rope_tables(np.concatenate([np.zeros((L, 3)), image_ids(H, W)]), model.axes_dims_rope)  # host, float64
    v = unpack(Flux(**hparams).apply({"params": params}, tokens, t, text_tokens, pooled, rope, guidance), H, W)

Shapes (B batch, N image tokens, L text tokens):
    tokens       [B, N, in_channels]        packed latents: each token a 2 x 2 patch of the 16-channel VAE latent (64)
    t            [B]                        flow time sigma in [0, 1]; the model sees `timestep_scale * t`
    text_tokens  [B, L, joint_attention_dim] T5's sequence
    pooled       [B, pooled_projection_dim] CLIP-L's pooled output
    rope         (cos, sin) [L + N, head_dim] `rope_tables` of the text ids then the image ids
    guidance     [B] or None                FLUX.1-dev's distilled guidance scale (`guidance_embeds`); None for schnell
    v            [B, N, out_channels]       predicted velocity `eps - x0` per token

What differs from the MMDiT (`mmdit.py`, whose layers this reuses): `num_layers` double-stream blocks attend over
[text, image] (text first) with 3-axis rotary embeddings on q and k; then `num_single_layers` single-stream blocks
run one sequence with attention and MLP in parallel (`proj_out` of their concatenation); the conditioning vector adds
a guidance MLP. Parameter names mirror the diffusers state_dict (`convert.flux_key`). Runs of equal blocks scan as the
MMDiT's do (`scan.py`, `mmdit.scans`), rematerialized under `remat`; every projection is a LoRA-able `Dense`.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.attention import attend
from flowrl_jax.models.lora import FLOW_GRPO_FLUX_TARGETS
from flowrl_jax.models.mmdit import Attention, Dense, FeedForward, Modulation, layer_norm, modulate, scans, timestep_embedding
from flowrl_jax.models.scan import scan_layers

Dtype = Any


def pack(latents: jax.Array) -> jax.Array:
    """[B, H, W, C] latents -> [B, (H/2)(W/2), 4 C] tokens, row-major, each token's elements (C, 2, 2) (diffusers'
    `FluxPipeline._pack_latents` on NCHW)."""
    b, h, w, c = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latents of {h}x{w}: FLUX packs 2 x 2, so both sides must be even (images a multiple of 16)")
    x = latents.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens: jax.Array, height: int, width: int) -> jax.Array:
    """[B, (H/2)(W/2), 4 C] -> [B, H, W, C] latents; the inverse of `pack` (H, W in latent pixels)."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, d // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, height, width, d // 4)


def image_ids(height: int, width: int) -> np.ndarray:
    """[(H/2)(W/2), 3] float32: (0, row, column) of each packed token of H x W latents (`_prepare_latent_image_ids`);
    text ids are zeros [L, 3]."""
    ids = np.zeros((height // 2, width // 2, 3), np.float32)
    ids[..., 1], ids[..., 2] = np.arange(height // 2)[:, None], np.arange(width // 2)[None]
    return ids.reshape(-1, 3)


def rope_tables(ids: np.ndarray, axes_dims: Sequence[int], theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """ids [S, A] -> (cos, sin) float32 [S, sum(axes_dims)]. Axis a's angles are pos_a * theta^(-2i / d_a),
    i < d_a / 2, computed in float64 as diffusers' `FluxPosEmbed` does, each repeated twice (one per pair member)."""
    pos = np.asarray(ids, np.float32).astype(np.float64)
    if pos.shape[-1] != len(axes_dims):
        raise ValueError(f"ids have {pos.shape[-1]} axes but axes_dims_rope has {len(axes_dims)}: {tuple(axes_dims)}")
    cos, sin = [], []
    for axis, d in enumerate(axes_dims):
        angles = np.outer(pos[:, axis], 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d))
        cos.append(np.repeat(np.cos(angles), 2, axis=1))
        sin.append(np.repeat(np.sin(angles), 2, axis=1))
    return np.concatenate(cos, 1).astype(np.float32), np.concatenate(sin, 1).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, H, D] rotated pair by pair ((x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)), cos/sin [S, D]; in
    float32 (diffusers' `apply_rotary_emb`, use_real_unbind_dim=-1)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out = x.astype(jnp.float32) * cos[None, :, None] + rotated.astype(jnp.float32) * sin[None, :, None]
    return out.astype(x.dtype)


class RotaryAttention(Attention):
    """Attention with rotary q and k: joint over [text, image] (text first, as diffusers' `FluxAttnProcessor`) when
    `context` is given -> (image_out, text_out), else self-attention with no output projection (the single blocks')."""

    @nn.compact
    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], context: jax.Array | None = None):
        dim = self.heads * self.head_dim
        q, k, v = self._project(x, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        if context is not None:
            cq, ck, cv = self._project(context, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attend(q, k, v, self.attention).reshape(q.shape[0], q.shape[1], dim)
        if context is None:
            return out
        n_text = context.shape[1]
        return self.dense(dim, name="to_out")(out[:, n_text:]), self.dense(dim, name="to_add_out")(out[:, :n_text])


class FluxBlock(nn.Module):
    """What both kinds of block hold: the width, the heads, the LoRA-able `Dense` and the attention implementation."""

    dim: int
    heads: int
    head_dim: int
    dense: Any
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"

    def rotary_attention(self, joint: bool) -> RotaryAttention:
        return RotaryAttention(self.heads, self.head_dim, "rms_norm", joint=joint, context_pre_only=False, dense=self.dense,
                               param_dtype=self.param_dtype, attention=self.attention, name="attn")


class DoubleBlock(FluxBlock):
    """diffusers `FluxTransformerBlock`: adaLN-Zero on both streams, joint rotary attention, an MLP each.
    x [B, N, D], context [B, L, D], temb [B, D], rope ([L + N, head_dim] x 2) -> (x, context)."""

    @nn.compact
    def __call__(self, x, context, temb, cos, sin):
        dim, dense = self.dim, self.dense
        sh, sc, g, sh_mlp, sc_mlp, g_mlp = Modulation(dim, 6, dense, name="norm1")(temb)
        c_sh, c_sc, c_g, c_sh_mlp, c_sc_mlp, c_g_mlp = Modulation(dim, 6, dense, name="norm1_context")(temb)
        attn_out, context_out = self.rotary_attention(joint=True)(modulate(layer_norm(x), sh, sc), (cos, sin),
                                                                   modulate(layer_norm(context), c_sh, c_sc))
        x = x + g[:, None] * attn_out
        x = x + g_mlp[:, None] * FeedForward(dim, dense, name="ff")(modulate(layer_norm(x), sh_mlp, sc_mlp))
        context = context + c_g[:, None] * context_out
        context = context + c_g_mlp[:, None] * FeedForward(dim, dense, name="ff_context")(
            modulate(layer_norm(context), c_sh_mlp, c_sc_mlp))
        return x, context


class SingleBlock(FluxBlock):
    """diffusers `FluxSingleTransformerBlock` on h = [text, image] [B, L + N, D]: one adaLN-Zero, rotary attention and a
    4x MLP in parallel, `proj_out` of their concatenation, gated."""

    @nn.compact
    def __call__(self, h, temb, cos, sin):
        sh, sc, g = Modulation(self.dim, 3, self.dense, name="norm")(temb)
        normed = modulate(layer_norm(h), sh, sc)
        mlp = nn.gelu(self.dense(4 * self.dim, name="proj_mlp")(normed), approximate=True)
        attn = self.rotary_attention(joint=False)(normed, (cos, sin))
        return h + g[:, None] * self.dense(self.dim, name="proj_out")(jnp.concatenate([attn, mlp], axis=-1))


class Flux(nn.Module):
    """FLUX.1's transformer; hyper-parameters as diffusers' `FluxTransformer2DModel` (module doc)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: Sequence[int] = (16, 56, 56)
    # Beyond diffusers' hyper-parameters, as the MMDiT's:
    timestep_scale: float = 1000.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    lora_alpha: float = 64.0
    remat: bool = False
    attention: str = "xla"
    scan_blocks: str = "auto"

    lora_targets = FLOW_GRPO_FLUX_TARGETS  # flow_grpo's FLUX LoRA (`lora.init_adapters`)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    def dummy_inputs(self, batch: int = 1, text_len: int = 1, tokens: int = 4):
        """Zeros of the right shapes, for `init`/`eval_shape`: (tokens, t, text_tokens, pooled, rope, guidance)."""
        rope = tuple(jnp.zeros((text_len + tokens, self.attention_head_dim), jnp.float32) for _ in range(2))
        return (jnp.zeros((batch, tokens, self.in_channels), jnp.float32), jnp.zeros((batch,), jnp.float32),
                jnp.zeros((batch, text_len, self.joint_attention_dim), jnp.float32),
                jnp.zeros((batch, self.pooled_projection_dim), jnp.float32), rope,
                jnp.ones((batch,), jnp.float32) if self.guidance_embeds else None)

    def _blocks(self, cls, prefix: str, count: int, kw: dict, carry, call):
        """`count` blocks `prefix_i` of `cls` in order on `carry`: one `lax.scan` when `mmdit.scans` says so, else a
        loop; `call(block, variables or None, carry) -> carry`."""
        names = [f"{prefix}_{i}" for i in range(count)]
        if count > 1 and scans(self.scan_blocks, self.remat, self.inner_dim) and not self.is_initializing():
            block = cls(parent=None, **kw)
            return scan_layers(self.variables, names, lambda v, c: call(block, v, c), carry, self.remat)
        block_cls = nn.remat(cls) if self.remat else cls
        for name in names:
            carry = call(block_cls(name=name, **kw), None, carry)
        return carry

    def __call__(self, tokens, t, text_tokens, pooled, rope, guidance=None) -> jax.Array:
        return self.forward(tokens, t, text_tokens, pooled, rope, guidance)

    @nn.compact
    def forward(self, tokens, t, text_tokens, pooled, rope, guidance=None) -> jax.Array:
        """The transformer on packed tokens (module doc's shapes); `__call__` of `Flux`, what `FluxLatents` wraps."""
        if len(self.axes_dims_rope) != 3 or sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope={tuple(self.axes_dims_rope)} must be 3 dims summing to attention_head_dim="
                             f"{self.attention_head_dim}")
        if self.guidance_embeds == (guidance is None):
            raise ValueError("this FLUX model " + ("embeds a guidance scale (FLUX.1-dev): pass guidance [B]" if self.guidance_embeds
                                                   else "has no guidance embedding (FLUX.1-schnell): pass guidance=None"))
        dim = self.inner_dim
        dense = functools.partial(Dense, dtype=self.dtype, param_dtype=self.param_dtype, lora_alpha=self.lora_alpha)

        def mlp(name, x):  # diffusers `TimestepEmbedding` / `PixArtAlphaTextProjection`: linear, silu, linear
            return dense(dim, name=f"{name}_linear_2")(nn.silu(dense(dim, name=f"{name}_linear_1")(x)))

        temb = mlp("time", timestep_embedding(t * self.timestep_scale, 256).astype(self.dtype))
        if guidance is not None:
            temb = temb + mlp("guidance", timestep_embedding(guidance * self.timestep_scale, 256).astype(self.dtype))
        temb = temb + mlp("text", pooled.astype(self.dtype))
        h = dense(dim, name="x_embedder")(tokens)
        context = dense(dim, name="context_embedder")(text_tokens)
        cos, sin = (jnp.asarray(r, jnp.float32) for r in rope)

        kw = dict(dim=dim, heads=self.num_attention_heads, head_dim=self.attention_head_dim, dense=dense,
                  param_dtype=self.param_dtype, attention=self.attention)
        h, context = self._blocks(DoubleBlock, "transformer_blocks", self.num_layers, kw, (h, context),
                                  lambda b, v, c: (b.apply(v, *c, temb, cos, sin) if v is not None else b(*c, temb, cos, sin)))
        n_text = context.shape[1]
        joint = self._blocks(SingleBlock, "single_transformer_blocks", self.num_single_layers, kw,
                             jnp.concatenate([context, h], axis=1),
                             lambda b, v, c: (b.apply(v, c, temb, cos, sin) if v is not None else b(c, temb, cos, sin)))
        h = joint[:, n_text:]
        scale, shift = Modulation(dim, 2, dense, name="norm_out")(temb)  # AdaLayerNormContinuous: (scale, shift)
        out = dense(self.patch_size ** 2 * self.output_channels, kernel_init=nn.initializers.zeros, name="proj_out")(
            modulate(layer_norm(h), shift, scale))
        return out.astype(jnp.float32)


class FluxLatents(Flux):
    """FLUX as the RL loop sees every DiT: `(x [B, H, W, C] latents, sigma [B], text_tokens, pooled) -> v [B, H, W, C]`.

    Packs the latents 2 x 2, builds the rotary tables of the text ids (zeros) and the image ids from the static shapes
    (host constants at trace time), feeds the distilled guidance `guidance_scale` to every row (None: a model without a
    guidance embedding, FLUX.1-schnell), and unpacks the velocity. Parameters are `Flux`'s, unchanged."""

    guidance_scale: float | None = 3.5

    @property
    def token_patch(self) -> int:
        """Latent pixels per side of one packed token (2): the tokens of the per-token log-probs and credit maps."""
        return 2

    def __call__(self, x, sigma, text_tokens, pooled) -> jax.Array:
        b, h, w, _ = x.shape
        ids = np.concatenate([np.zeros((text_tokens.shape[1], 3), np.float32), image_ids(h, w)])
        rope = rope_tables(ids, self.axes_dims_rope)
        guidance = None if not self.guidance_embeds else jnp.full((b,), self.guidance_scale, jnp.float32)
        return unpack(self.forward(pack(x), sigma, text_tokens, pooled, rope, guidance), h, w)

    @property
    def latent_channels(self) -> int:
        return self.in_channels // 4

    def dummy_inputs(self, batch: int = 1, text_len: int = 1, height: int = 2, width: int = 2):
        """Zeros of `__call__`'s shapes (latents [B, H, W, C], t, text_tokens, pooled), for `init`/`eval_shape`."""
        return (jnp.zeros((batch, height, width, self.latent_channels), jnp.float32), jnp.zeros((batch,), jnp.float32),
                jnp.zeros((batch, text_len, self.joint_attention_dim), jnp.float32),
                jnp.zeros((batch, self.pooled_projection_dim), jnp.float32))
