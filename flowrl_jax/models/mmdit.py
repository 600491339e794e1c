"""SD3/SD3.5 MMDiT in Flax linen, a pure-functional port of diffusers' `SD3Transformer2DModel`.

    v = MMDiT(**hparams).apply({"params": params}, x, t, text_tokens, pooled)

Shapes (B batch, H x W image or latent, C channels, L text tokens):
    x            [B, H, W, C]               NHWC (diffusers is NCHW; `convert.py` handles weights)
    t            [B]                        flow time sigma in [0, 1]; the DiT sees `timestep_scale * t`
                                            (1000 * sigma, diffusers' convention, docs/math.md §0)
    text_tokens  [B, L, joint_attention_dim]
    pooled       [B, pooled_projection_dim]
    v            [B, H, W, out_channels]    predicted velocity `eps - x0`

A DiT token is one p x p patch; `patchify`/`unpatchify` fix the token order (row-major over the
(H/p, W/p) grid) and the element order inside a token (p, p, C) that diffusers' unpatchify uses, so
the per-token log-probs of the samplers and the DiT agree on what a token is.

Module and parameter names mirror the diffusers state_dict (`transformer_blocks_3/attn/to_q/kernel`
for `transformer_blocks.3.attn.to_q.weight`) so that `convert.py` is a short table, not a guess.

LoRA: every projection is a `Dense` that, when the variables passed to `apply` hold a `lora`
collection entry at its path (`{"a": [in, r], "b": [r, out]}`, built by `lora.py`), adds
`(lora_alpha / r) * x @ a @ b` to its output. The base params stay untouched.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.attention import attend
from flowrl_jax.models.lora import FLOW_GRPO_TARGETS
from flowrl_jax.models.scan import scan_layers

Dtype = Any
SCAN_CHOICES = ("auto", "always", "never")
SCAN_MIN_WIDTH = 1024  # "auto" scans the blocks of MMDiTs at least this wide (SD3: 1536, SD3.5-L: 2432)


# ----------------------------------------------------------------------------- token layout


def patchify(x: jax.Array, patch_size: int) -> jax.Array:
    """[B, H, W, C] -> [B, N, p*p*C] with N = (H/p)(W/p), tokens row-major, elements (p, p, C)."""
    b, h, w, c = x.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch_size={p}")
    x = x.reshape(b, h // p, p, w // p, p, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: jax.Array, patch_size: int, height: int, width: int) -> jax.Array:
    """[B, N, p*p*C] -> [B, H, W, C]; the inverse of `patchify` (diffusers' "nhwpqc->nchpwq")."""
    b, n, d = tokens.shape
    p = patch_size
    gh, gw = height // p, width // p
    c = d // (p * p)
    if gh * gw != n or c * p * p != d:
        raise ValueError(f"{n} tokens of size {d} do not tile a {height}x{width} image at patch {p}")
    x = tokens.reshape(b, gh, gw, p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, height, width, c)


# ----------------------------------------------------------------------------- embeddings


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """[M] -> [M, dim]: [sin(pos * w), cos(pos * w)], w_i = 10000^(-i / (dim/2)) (float64)."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.outer(pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


@functools.lru_cache(maxsize=32)
def sincos_pos_embed_2d(dim: int, grid_size: int, base_size: int) -> np.ndarray:
    """The SD3 position table [grid_size, grid_size, dim] (float32).

    Grid coordinates are `arange(grid) * base_size / grid_size`; the first half of the channels
    encodes the column (w) coordinate and the second half the row (h), as diffusers'
    `get_2d_sincos_pos_embed` does (its meshgrid puts w first).
    """
    if dim % 4:
        raise ValueError(f"the 2D sin-cos position embedding needs dim % 4 == 0, got {dim}")
    coords = np.arange(grid_size, dtype=np.float64) / (grid_size / base_size)
    rows, cols = np.meshgrid(coords, coords, indexing="ij")
    table = np.concatenate([_sincos_1d(dim // 2, cols.reshape(-1)), _sincos_1d(dim // 2, rows.reshape(-1))], axis=1)
    table = table.reshape(grid_size, grid_size, dim).astype(np.float32)
    table.setflags(write=False)  # cached and shared
    return table


def cropped_pos_embed(dim: int, max_size: int, base_size: int, gh: int, gw: int) -> np.ndarray:
    """The centre crop [gh * gw, dim] of the max_size x max_size table (diffusers' cropping)."""
    if gh > max_size or gw > max_size:
        raise ValueError(f"token grid {gh}x{gw} exceeds pos_embed_max_size={max_size}")
    top, left = (max_size - gh) // 2, (max_size - gw) // 2
    table = sincos_pos_embed_2d(dim, max_size, base_size)
    return table[top : top + gh, left : left + gw].reshape(gh * gw, dim)


def timestep_embedding(timesteps: jax.Array, dim: int = 256, max_period: float = 10000.0) -> jax.Array:
    """[B] -> [B, dim]: [cos(t w), sin(t w)], w_i = max_period^(-i / (dim/2)) (diffusers `Timesteps`
    with flip_sin_to_cos=True, downscale_freq_shift=0)."""
    half = dim // 2
    freqs = jnp.exp(-np.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = timesteps.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


# ----------------------------------------------------------------------------- layers


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm without affine parameters over the last axis, computed in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class Dense(nn.Module):
    """`x @ kernel + bias` (kernel [in, out]) plus an optional LoRA term from the `lora` collection."""

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Any = nn.initializers.xavier_uniform()
    lora_alpha: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).astype(self.dtype)  # 2-D matmuls: XLA:CPU runs [B, N, D] dots ~2x slower
        kernel = kernel.astype(self.dtype)
        lora = self.has_variable("lora", "a")
        if lora:
            a = self.get_variable("lora", "a").astype(self.dtype)
            b = self.get_variable("lora", "b").astype(self.dtype)
            scale = self.lora_alpha / a.shape[-1]
            if merge_lora_in_forward(*kernel.shape, a.shape[-1]):
                kernel, lora = kernel + scale * jnp.dot(a, b), False
        y = jnp.dot(x, kernel) + bias.astype(self.dtype)
        if lora:
            y = y + scale * jnp.dot(jnp.dot(x, a), b)
        return y.reshape(*lead, self.features)


def merge_lora_in_forward(d_in: int, d_out: int, rank: int) -> bool:
    """Whether a LoRA layer runs as one matmul with `W + s a b` (True) or as `x W + s (x a) b`. Merged, the
    backward pays a weight gradient, `2 rows d_in d_out` FLOPs; unmerged, the adapters cost `2 rows r (d_in + d_out)`
    forward and twice that backward, in skinny `[rows, r]` matmuls that ran ~3x below the machine's peak on CPU.
    Merge when `d_in d_out <= 9 r (d_in + d_out)`: widths 128 and 512 at r = 32 merge (measured faster, issue 7
    in WORKSPACE_NOTES.md), SD3's 1536 does not."""
    return d_in * d_out <= 9 * rank * (d_in + d_out)


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * scale` over the last axis (diffusers `RMSNorm`, float32)."""

    eps: float = 1e-6
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


class Modulation(nn.Module):
    """adaLN: `linear(silu(temb))` split into `chunks` vectors of width `dim` (zero-initialized)."""

    dim: int
    chunks: int
    dense: Any

    @nn.compact
    def __call__(self, temb: jax.Array) -> list[jax.Array]:
        out = self.dense(self.chunks * self.dim, kernel_init=nn.initializers.zeros, name="linear")(nn.silu(temb))
        return jnp.split(out, self.chunks, axis=-1)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """`x * (1 + scale) + shift`, x [B, N, D], shift/scale [B, D]."""
    return x * (1 + scale[:, None]) + shift[:, None]


class FeedForward(nn.Module):
    """dim -> 4 dim -> dim with tanh-GELU (diffusers `FeedForward(activation_fn="gelu-approximate")`)."""

    dim: int
    dense: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(self.dense(4 * self.dim, name="fc1")(x), approximate=True)
        return self.dense(self.dim, name="fc2")(h)


class Attention(nn.Module):
    """Multi-head attention over the image stream, optionally joint with a text stream.

    With `context` given, image and text queries/keys/values are concatenated ([image, text], as
    diffusers' `JointAttnProcessor2_0`) into one softmax attention, and the output is split back.
    Returns `(image_out [B, N, D], text_out [B, L, D] or None)`.
    """

    heads: int
    head_dim: int
    qk_norm: str | None
    joint: bool
    context_pre_only: bool
    dense: Any
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"  # implementation (`attention.IMPLEMENTATIONS`)

    def _project(self, x, names, norm_names):
        b, n, _ = x.shape
        q, k, v = (self.dense(self.heads * self.head_dim, name=nm)(x).reshape(b, n, self.heads, self.head_dim) for nm in names)
        if self.qk_norm == "rms_norm":
            q = RMSNorm(param_dtype=self.param_dtype, name=norm_names[0])(q)
            k = RMSNorm(param_dtype=self.param_dtype, name=norm_names[1])(k)
        elif self.qk_norm is not None:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; use None or 'rms_norm'")
        return q, k, v

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None):
        dim = self.heads * self.head_dim
        q, k, v = self._project(x, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        if self.joint:
            cq, ck, cv = self._project(context, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((q, cq), (k, ck), (v, cv)))
        out = attend(q, k, v, self.attention).reshape(q.shape[0], q.shape[1], dim)
        n = x.shape[1]
        image_out = self.dense(dim, name="to_out")(out[:, :n])
        if not self.joint or self.context_pre_only:
            return image_out, None
        return image_out, self.dense(dim, name="to_add_out")(out[:, n:])


class JointBlock(nn.Module):
    """One MMDiT block (diffusers `JointTransformerBlock`): adaLN-Zero on both streams, joint
    attention, optional second image-only attention (SD3.5 "dual attention"), MLPs.

    The last block is `context_pre_only`: its text stream only feeds the attention.
    x [B, N, D], context [B, L, D], temb [B, D] -> (x, context or None).
    """

    dim: int
    heads: int
    head_dim: int
    qk_norm: str | None
    context_pre_only: bool
    dual_attention: bool
    dense: Any
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"

    @nn.compact
    def __call__(self, x, context, temb):
        dim, dense = self.dim, self.dense
        attn_kw = dict(heads=self.heads, head_dim=self.head_dim, qk_norm=self.qk_norm, dense=dense, param_dtype=self.param_dtype,
                       attention=self.attention)

        if self.dual_attention:
            (sh_msa, sc_msa, g_msa, sh_mlp, sc_mlp, g_mlp, sh_msa2, sc_msa2, g_msa2) = Modulation(dim, 9, dense, name="norm1")(temb)
        else:
            sh_msa, sc_msa, g_msa, sh_mlp, sc_mlp, g_mlp = Modulation(dim, 6, dense, name="norm1")(temb)
        x_norm = layer_norm(x)

        if self.context_pre_only:  # AdaLayerNormContinuous: (scale, shift), no gates
            c_sc, c_sh = Modulation(dim, 2, dense, name="norm1_context")(temb)
        else:
            c_sh, c_sc, c_g_msa, c_sh_mlp, c_sc_mlp, c_g_mlp = Modulation(dim, 6, dense, name="norm1_context")(temb)
        context_in = modulate(layer_norm(context), c_sh, c_sc)

        attn_out, context_attn_out = Attention(joint=True, context_pre_only=self.context_pre_only, name="attn", **attn_kw)(
            modulate(x_norm, sh_msa, sc_msa), context_in
        )
        x = x + g_msa[:, None] * attn_out
        if self.dual_attention:
            attn2_out, _ = Attention(joint=False, context_pre_only=False, name="attn2", **attn_kw)(modulate(x_norm, sh_msa2, sc_msa2))
            x = x + g_msa2[:, None] * attn2_out
        x = x + g_mlp[:, None] * FeedForward(dim, dense, name="ff")(modulate(layer_norm(x), sh_mlp, sc_mlp))

        if self.context_pre_only:
            return x, None
        context = context + c_g_msa[:, None] * context_attn_out
        context = context + c_g_mlp[:, None] * FeedForward(dim, dense, name="ff_context")(modulate(layer_norm(context), c_sh_mlp, c_sc_mlp))
        return x, context


def scans(scan_blocks: str, remat: bool, width: int) -> bool:
    """Whether runs of equal blocks run as one `lax.scan` (one compile per run) or a Python loop (one per block).
    "auto": scan under remat (remat saves memory only in a scan) and from width SCAN_MIN_WIDTH on (the SD3 family);
    below it the loop ran as fast or faster on CPU and compiled as fast (WORKSPACE_NOTES.md, issue 32)."""
    if scan_blocks not in SCAN_CHOICES:
        raise ValueError(f"scan_blocks={scan_blocks!r}; choose one of {SCAN_CHOICES}")
    if scan_blocks == "auto":
        return remat or width >= SCAN_MIN_WIDTH
    return scan_blocks == "always"


def block_runs(kinds) -> list[tuple[int, int]]:
    """[(start, stop)] of the maximal runs of consecutive equal `kinds` (a block's structure)."""
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((start, i))
            start = i
    return runs


class MMDiT(nn.Module):
    """SD3-style multimodal DiT; hyper-parameters as diffusers' `SD3Transformer2DModel` (module doc)."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int | None = 96
    dual_attention_layers: Sequence[int] = ()
    qk_norm: str | None = None
    # Beyond diffusers' hyper-parameters:
    timestep_scale: float = 1000.0  # the DiT sees timestep_scale * sigma
    dtype: Dtype = jnp.float32  # compute dtype
    param_dtype: Dtype = jnp.float32
    lora_alpha: float = 64.0  # LoRA scale is lora_alpha / rank (only used when adapters are passed)
    remat: bool = False  # rematerialize each block in the backward pass (jax.checkpoint)
    attention: str = "xla"  # attention implementation: "xla", "cudnn" (GPU flash), "splash" (TPU Pallas); attention.py
    scan_blocks: str = "auto"  # runs of equal blocks as one lax.scan (scan.py): "auto" (`scans_blocks`), "always", "never"

    lora_targets = FLOW_GRPO_TARGETS  # the kernels LoRA adapts (a regex over param paths; `lora.init_adapters`)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def token_patch(self) -> int:
        """Latent pixels per side of one token (the patch size): the tokens of the per-token log-probs and credit maps."""
        return self.patch_size

    @property
    def output_channels(self) -> int:
        return self.out_channels if self.out_channels is not None else self.in_channels

    def dummy_inputs(self, batch: int = 1, text_len: int = 1, height: int | None = None, width: int | None = None):
        """Zeros of the right shapes, for `init`/`eval_shape`: (x, t, text_tokens, pooled)."""
        h, w = height or self.sample_size, width or self.sample_size
        return (
            jnp.zeros((batch, h, w, self.in_channels), jnp.float32),
            jnp.zeros((batch,), jnp.float32),
            jnp.zeros((batch, text_len, self.joint_attention_dim), jnp.float32),
            jnp.zeros((batch, self.pooled_projection_dim), jnp.float32),
        )

    def _scanned_run(self, start: int, stop: int, kind, block_kw: dict, h, context, temb):
        """Blocks `start .. stop - 1` (one structure) as one `lax.scan` (`scan.scan_layers`), remat'd under `remat`."""
        block = JointBlock(dual_attention=kind[0], context_pre_only=kind[1], parent=None, **block_kw)
        names = [f"transformer_blocks_{i}" for i in range(start, stop)]
        return scan_layers(self.variables, names, lambda v, carry: block.apply(v, *carry, temb), (h, context), self.remat)

    @property
    def scans_blocks(self) -> bool:
        return scans(self.scan_blocks, self.remat, self.inner_dim)

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array, text_tokens: jax.Array, pooled: jax.Array) -> jax.Array:
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(
                f"caption_projection_dim={self.caption_projection_dim} must equal num_attention_heads * "
                f"attention_head_dim = {self.inner_dim} (the joint blocks share one width)"
            )
        b, height, width, _ = x.shape
        p, dim = self.patch_size, self.inner_dim
        dense = functools.partial(Dense, dtype=self.dtype, param_dtype=self.param_dtype, lora_alpha=self.lora_alpha)

        # Patch embedding (a stride-p conv == a dense layer on patchified tokens) + cropped positions.
        h = dense(dim, name="pos_embed_proj")(patchify(x, p))
        gh, gw = height // p, width // p
        max_size = self.pos_embed_max_size or max(gh, gw)
        pos = cropped_pos_embed(dim, max_size, self.sample_size // p, gh, gw)
        h = h + jnp.asarray(pos, self.dtype)[None]

        # Conditioning vector: timestep MLP + pooled-text MLP.
        t_freq = timestep_embedding(t * self.timestep_scale, 256).astype(self.dtype)
        temb = dense(dim, name="time_linear_1")(t_freq)
        temb = dense(dim, name="time_linear_2")(nn.silu(temb))
        pooled_emb = dense(dim, name="text_linear_1")(pooled)
        temb = temb + dense(dim, name="text_linear_2")(nn.silu(pooled_emb))

        context = dense(self.caption_projection_dim, name="context_embedder")(text_tokens)

        kinds = [(i in tuple(self.dual_attention_layers), i == self.num_layers - 1) for i in range(self.num_layers)]
        block_kw = dict(dim=dim, heads=self.num_attention_heads, head_dim=self.attention_head_dim, qk_norm=self.qk_norm, dense=dense,
                        param_dtype=self.param_dtype, attention=self.attention)
        block_cls = nn.remat(JointBlock) if self.remat else JointBlock
        scan = self.scans_blocks and not self.is_initializing()
        for start, stop in block_runs(kinds) if scan else [(i, i + 1) for i in range(self.num_layers)]:
            if stop - start > 1:
                h, context = self._scanned_run(start, stop, kinds[start], block_kw, h, context, temb)
            else:
                h, context = block_cls(dual_attention=kinds[start][0], context_pre_only=kinds[start][1],
                                       name=f"transformer_blocks_{start}", **block_kw)(h, context, temb)

        scale, shift = Modulation(dim, 2, dense, name="norm_out")(temb)
        h = modulate(layer_norm(h), shift, scale)
        out = dense(p * p * self.output_channels, kernel_init=nn.initializers.zeros, name="proj_out")(h)
        return unpatchify(out, p, height, width).astype(jnp.float32)
