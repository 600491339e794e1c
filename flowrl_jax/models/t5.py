"""The T5 v1.1 encoder (SD3's T5-XXL text encoder) in Flax linen, a port of transformers' `T5EncoderModel`.

    model, params = load("path/to/sd3/text_encoder_3")              # config.json + model*.safetensors
    hidden = model.apply({"params": params}, ids, mask)             # [B, L] int, [B, L] bool -> [B, L, d_model]
    params = from_state_dict(model, torch_model.state_dict())       # any {name: array-like}
    shardings = parallel.tree_shardings(params, mesh, PARTITION_RULES)

Shapes (B batch, L tokens, D = d_model, H heads, d = d_kv):
    ids     [B, L]  int token ids;  mask [B, L] (1 = token, 0 = padding) or None (all tokens)
    hidden  [B, L, D] float32 `last_hidden_state`; padded positions are computed too (their queries
            attend to the real tokens), exactly as transformers does

Each block is [RMS-norm -> self-attention (no 1/sqrt(d) scaling, T5 relative position bias) ->
residual] then [RMS-norm -> gated-GELU FFN -> residual]; a final RMS-norm closes the stack. The
relative position bias [1, H, L, L] comes from block 0's table and is reused by every block.

Dtypes: `dtype` is the matmul compute dtype; norms, softmax and the residual stream stay float32
(T5's activations are large, and 2 * num_layers residual adds in bfloat16 would lose them).

Module and parameter names mirror the transformers state_dict (`block_3/layer_1/DenseReluDense/wi_0/kernel`
for `encoder.block.3.layer.1.DenseReluDense.wi_0.weight`), so `t5_key` is three regexes.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models import convert
from flowrl_jax.models.mmdit import RMSNorm
from flowrl_jax.models.scan import scan_layers

Dtype = Any

# FSDP for the 4.7B-parameter encoder: every kernel and the [vocab, D] embedding shard their largest
# divisible dim over `fsdp`; the norm scales [D] and the relative-position table [buckets, H] are tiny.
PARTITION_RULES = (
    (r"(^shared/embedding|/kernel)$", "fsdp"),
    (r".*", "replicate"),
)

HPARAMS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
           "relative_attention_max_distance", "layer_norm_epsilon")
_TIED_KEY = "encoder.embed_tokens.weight"  # tied to shared.weight in T5EncoderModel


# ----------------------------------------------------------------------------- relative positions


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """[L, L] int32 bucket of `key - query` for a bidirectional encoder (transformers'
    `T5Attention._relative_position_bucket`): half the buckets per direction; within one, distances
    below `num_buckets // 4` get a bucket each, larger ones log-spaced bins up to `max_distance`, beyond
    which all share the last bucket."""
    rel = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    max_exact = half // 2
    n = np.abs(rel)
    # The log-bin index is an exact integer at some distances (16, 32, 64 for T5's 32 buckets / 128):
    # the 1e-6 slack makes floor take the exact-arithmetic value there, as transformers' float32 code does
    # (tested over +-1000), whatever the last bit of this platform's log.
    log_bin = np.log(np.maximum(n, 1) / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    large = np.minimum(max_exact + np.floor(log_bin + 1e-6).astype(np.int64), half - 1)
    return ((rel > 0) * half + np.where(n < max_exact, n, large)).astype(np.int32)


# ----------------------------------------------------------------------------- layers


class SelfAttention(nn.Module):
    """T5 self-attention (transformers `T5Attention`, encoder): bias-free q/k/v/o, scores `q k^T`
    without 1/sqrt(d) scaling, plus the position bias and the padding bias.

    x [B, L, D], position_bias [1, H, L, L] or None (block 0 computes it from its table),
    mask_bias [B, 1, 1, L] -> (out [B, L, D], position_bias)."""

    num_heads: int
    d_kv: int
    num_buckets: int
    max_distance: int
    has_relative_attention_bias: bool
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, position_bias, mask_bias):
        b, length, d_model = x.shape
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        q, k, v = (dense(self.num_heads * self.d_kv, name=name)(x).reshape(b, length, self.num_heads, self.d_kv)
                   for name in ("q", "k", "v"))
        if position_bias is None:
            if not self.has_relative_attention_bias:
                raise ValueError("only the first block owns the relative position table; pass its position_bias on")
            table = nn.Embed(self.num_buckets, self.num_heads, param_dtype=self.param_dtype,
                             name="relative_attention_bias")
            buckets = relative_position_buckets(length, self.num_buckets, self.max_distance)
            position_bias = table(jnp.asarray(buckets)).astype(jnp.float32).transpose(2, 0, 1)[None]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits + position_bias + mask_bias, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        out = out.astype(self.dtype).reshape(b, length, self.num_heads * self.d_kv)
        return dense(d_model, name="o")(out), position_bias


class GatedFeedForward(nn.Module):
    """`wo(gelu_new(wi_0 x) * wi_1 x)` (transformers `T5DenseGatedActDense`; gelu_new is the tanh
    approximation `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`). x [B, L, D] -> [B, L, D]."""

    d_ff: int
    dense_act_fn: str = "gelu_new"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        if self.dense_act_fn != "gelu_new":
            raise ValueError(f"dense_act_fn={self.dense_act_fn!r} is not supported; T5 v1.1 (gated-gelu) uses 'gelu_new'")
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.gelu(dense(self.d_ff, name="wi_0")(x), approximate=True) * dense(self.d_ff, name="wi_1")(x)
        return dense(x.shape[-1], name="wo")(h)


class SelfAttentionLayer(nn.Module):
    """`x + SelfAttention(RMSNorm(x))` (transformers `T5LayerSelfAttention`); x float32 [B, L, D]."""

    attention: dict
    eps: float
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, position_bias, mask_bias):
        h = RMSNorm(self.eps, self.param_dtype, name="layer_norm")(x)
        out, position_bias = SelfAttention(**self.attention, param_dtype=self.param_dtype, name="SelfAttention")(
            h, position_bias, mask_bias)
        return x + out.astype(jnp.float32), position_bias


class FeedForwardLayer(nn.Module):
    """`x + GatedFeedForward(RMSNorm(x))` (transformers `T5LayerFF`); x float32 [B, L, D]."""

    feed_forward: dict
    eps: float
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = RMSNorm(self.eps, self.param_dtype, name="layer_norm")(x)
        out = GatedFeedForward(**self.feed_forward, param_dtype=self.param_dtype, name="DenseReluDense")(h)
        return x + out.astype(jnp.float32)


class Block(nn.Module):
    """One T5 encoder block (transformers `T5Block`): layer_0 attention, layer_1 feed-forward."""

    attention: dict
    feed_forward: dict
    eps: float
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, position_bias, mask_bias):
        x, position_bias = SelfAttentionLayer(self.attention, self.eps, self.param_dtype, name="layer_0")(
            x, position_bias, mask_bias)
        return FeedForwardLayer(self.feed_forward, self.eps, self.param_dtype, name="layer_1")(x), position_bias


class T5Encoder(nn.Module):
    """The T5 v1.1 encoder stack (transformers `T5EncoderModel`); defaults are T5-XXL's as in SD3.
    `__call__(ids [B, L], mask [B, L] or None) -> last_hidden_state [B, L, d_model]` float32."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "gelu_new"
    dtype: Dtype = jnp.float32  # matmul compute dtype
    param_dtype: Dtype = jnp.float32
    scan_layers: bool = True  # blocks 1.. as one lax.scan (scan.py: one compile, not one per block); False: a loop

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        b, length = ids.shape
        mask = jnp.ones((b, length), bool) if mask is None else jnp.asarray(mask).astype(bool)
        mask_bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]  # [B, 1, 1, L]
        x = nn.Embed(self.vocab_size, self.d_model, param_dtype=self.param_dtype, name="shared")(ids).astype(jnp.float32)
        feed_forward = dict(d_ff=self.d_ff, dense_act_fn=self.dense_act_fn, dtype=self.dtype)
        position_bias = None

        def block(i, **kw):  # block 0 alone holds the relative position bias; blocks 1.. are equal
            attention = dict(num_heads=self.num_heads, d_kv=self.d_kv, num_buckets=self.relative_attention_num_buckets,
                             max_distance=self.relative_attention_max_distance, has_relative_attention_bias=i == 0,
                             dtype=self.dtype)
            return Block(attention, feed_forward, self.layer_norm_epsilon, self.param_dtype, **kw)

        scan = self.scan_layers and not self.is_initializing() and self.num_layers > 2
        for i in range(1 if scan else self.num_layers):
            x, position_bias = block(i, name=f"block_{i}")(x, position_bias, mask_bias)
        if scan:  # one compiled block for blocks 1.. (scan.py)
            unbound = block(1, parent=None)
            x = scan_layers(self.variables, [f"block_{i}" for i in range(1, self.num_layers)],
                            lambda v, h: unbound.apply(v, h, position_bias, mask_bias)[0], x)
        return RMSNorm(self.layer_norm_epsilon, self.param_dtype, name="final_layer_norm")(x)


# ----------------------------------------------------------------------------- weights


def t5_key(path: str) -> str:
    """'block_3/layer_1/DenseReluDense/wi_0/kernel' -> 'encoder.block.3.layer.1.DenseReluDense.wi_0.weight'."""
    if path == "shared/embedding":
        return "shared.weight"
    key = re.sub(r"(block|layer)_(\d+)/", r"\1/\2/", path)
    key = re.sub(r"/(kernel|scale|embedding)$", "/weight", key)
    return "encoder." + key.replace("/", ".")


def config_from_json(config: Mapping[str, Any], **overrides) -> T5Encoder:
    """A `T5Encoder` from a transformers T5 `config.json` dict (other keys, e.g. dropout_rate, are ignored).
    The activation follows `T5Config`: `feed_forward_proj` "gated-gelu" -> gelu_new; only gated FFNs."""
    proj = config.get("feed_forward_proj", "relu")  # T5Config's default
    if not proj.startswith("gated-"):
        raise convert.ConversionError(
            f"feed_forward_proj={proj!r}: only T5 v1.1's gated feed-forward (wi_0, wi_1) is supported, e.g. 'gated-gelu'")
    act = "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]
    kwargs = {k: config[k] for k in HPARAMS if k in config}
    return T5Encoder(**kwargs, dense_act_fn=act, **overrides)


def from_state_dict(model: T5Encoder, state_dict: Mapping[str, Any]) -> dict:
    """A transformers T5EncoderModel state_dict ({name: array-like}) -> our params (in `model.param_dtype`).
    `encoder.embed_tokens.weight` (tied) is ignored, or stands in for a missing `shared.weight`; `decoder`
    keys are ignored, as `T5EncoderModel` does."""
    if "shared.weight" not in state_dict and _TIED_KEY in state_dict:
        state_dict = {**state_dict, "shared.weight": state_dict[_TIED_KEY]}
    abstract = convert.flat_abstract_params(model, jnp.zeros((1, 1), jnp.int32))
    def transpose(path, value):  # torch Linear weight [out, in] -> our kernel [in, out]
        return value.T if path.endswith("/kernel") else value

    return convert.convert_tree(abstract, state_dict, t5_key, transpose, model.param_dtype,
                                ignored=lambda key: key == _TIED_KEY or key.startswith("decoder."), what="T5Encoder")


def load(path: str, **overrides) -> tuple[T5Encoder, dict]:
    """A transformers T5 encoder folder (config.json + model.safetensors, sharded or not; an SD3 pipeline
    folder's `text_encoder_3/` is found too) -> (model, params). `overrides` set module fields (dtype,
    param_dtype). No torch import."""
    return convert.load_folder(path, config_from_json, from_state_dict, "a transformers T5EncoderModel folder",
                               "text_encoder_3", stem="model", **overrides)
