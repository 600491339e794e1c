"""The CLIP text encoder SD3 runs twice (CLIP-L/14, OpenCLIP bigG/14) and FLUX.1 once (CLIP-L/14, unprojected): a Flax
linen port of transformers' `CLIPTextModelWithProjection` and `CLIPTextModel`, with its weights loaded without torch.

    model, params = load("sd3/text_encoder")                        # config.json + model.safetensors (or sharded)
    hidden, pooled = model.apply({"params": params}, ids, mask)     # SD3's pair: hidden_layer=-2 (the default)

Shapes (B batch, L tokens, D hidden_size, P projection_dim):
    ids     [B, L] int         L <= max_position_embeddings
    mask    [B, L] bool/int    optional; 0 marks padding (not attended to). Attention is always causal.
    hidden  [B, L, D] float32  transformers' `hidden_states[hidden_layer]`: the embeddings are entry 0, layer i's output
                               entry i + 1, no final LayerNorm; `hidden_layer=None` gives `last_hidden_state` instead
                               (the last layer, final-LayerNormed). SD3 with `clip_skip` takes -(clip_skip + 2).
    pooled  [B, P] float32     `text_embeds`: the final-LayerNormed state at the EOS token, times `text_projection`;
                               with `projection=False` (a `CLIPTextModel` folder, FLUX's) `pooler_output` [B, D], unprojected

Only the requested hidden state is kept, not the whole tuple. The EOS token is, as in transformers'
`CLIPTextModel.forward`, the largest id of each row when `eos_token_id == 2` (configs written before transformers PR
#24773, SD3's among them) and else the first position holding `eos_token_id` (position 0 if there is none).
A query with no visible key (left padding before the first real token) gets an arbitrary finite value; CLIP
tokenizers pad on the right, where causal attention always sees the first token.

Parameter paths mirror the transformers state_dict (`layers_3/self_attn/q_proj/kernel` for
`text_model.encoder.layers.3.self_attn.q_proj.weight`), so `transformers_key` is a short table.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowrl_jax.models import convert
from flowrl_jax.models.scan import scan_layers

Dtype = Any

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # transformers QuickGELUActivation (CLIP-L)
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # GELUActivation: the exact erf form (bigG)
}
HPARAMS = (
    "vocab_size", "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers", "num_attention_heads",
    "max_position_embeddings", "hidden_act", "layer_norm_eps", "eos_token_id",
)
_POSITION_IDS_KEY = "text_model.embeddings.position_ids"  # a buffer (arange), not a parameter

# Our path (with "/") -> transformers key, applied in order; then "/" -> ".".
_FLAX_TO_TRANSFORMERS = (
    (r"^(token|position)_embedding/", r"text_model/embeddings/\1_embedding/"),
    (r"^layers_(\d+)/", r"text_model/encoder/layers.\1/"),
    (r"^final_layer_norm/", "text_model/final_layer_norm/"),
    (r"/(kernel|scale|embedding)$", "/weight"),
)


def transformers_key(flax_path: str) -> str:
    """'layers_0/mlp/fc1/kernel' -> 'text_model.encoder.layers.0.mlp.fc1.weight'."""
    key = flax_path
    for pattern, repl in _FLAX_TO_TRANSFORMERS:
        key = re.sub(pattern, repl, key)
    return key.replace("/", ".")


def eos_positions(ids: jax.Array, eos_token_id: int) -> jax.Array:
    """[B, L] -> [B]: the pooled token of each row (transformers `CLIPTextModel.forward`; rule in the module doc)."""
    if eos_token_id == 2:
        return jnp.argmax(ids, axis=-1)
    return jnp.argmax(ids == eos_token_id, axis=-1)


class CLIPAttention(nn.Module):
    """Causal multi-head self-attention, x [B, L, D], mask [B, L] or None -> [B, L, D] (transformers `CLIPAttention`
    under `CLIPTextModel`'s causal + padding mask); logits and softmax in float32 (`jax.nn.dot_product_attention`).
    `causal=False` is the vision tower's full attention (`clip_vision`)."""

    heads: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        b, length, dim = x.shape
        dense = functools.partial(nn.Dense, dim, dtype=self.dtype, param_dtype=self.param_dtype)
        q, k, v = (dense(name=f"{n}_proj")(x).reshape(b, length, self.heads, dim // self.heads) for n in "qkv")
        keys = None if mask is None else mask.astype(bool)[:, None, None, :]  # [B, 1, 1, L]: padding hides keys
        out = jax.nn.dot_product_attention(q, k, v, mask=keys, is_causal=self.causal)  # scale head_dim ** -0.5
        return dense(name="out_proj")(out.reshape(b, length, dim))


class CLIPMLP(nn.Module):
    """fc2(act(fc1(x))), [B, L, D] -> [B, L, D] (transformers `CLIPMLP`)."""

    intermediate_size: int
    hidden_act: str
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        h = ACTIVATIONS[self.hidden_act](dense(self.intermediate_size, name="fc1")(x))
        return dense(x.shape[-1], name="fc2")(h)


def _layer_norm(eps: float, param_dtype: Dtype, name: str) -> nn.LayerNorm:
    """torch `nn.LayerNorm` (weight -> `scale`) computed in float32, the two-pass variance."""
    return nn.LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype, use_fast_variance=False, name=name)


class CLIPEncoderLayer(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)); [B, L, D] -> [B, L, D] (transformers `CLIPEncoderLayer`).
    Shared by both towers: causal attention for text (the default), full attention for vision (`causal=False`)."""

    heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = _layer_norm(self.layer_norm_eps, self.param_dtype, "layer_norm1")(x).astype(self.dtype)
        x = x + CLIPAttention(self.heads, causal=self.causal, name="self_attn", **kw)(h, mask)
        h = _layer_norm(self.layer_norm_eps, self.param_dtype, "layer_norm2")(x).astype(self.dtype)
        return x + CLIPMLP(self.intermediate_size, self.hidden_act, name="mlp", **kw)(h)


class CLIPTextEncoder(nn.Module):
    """transformers `CLIPTextModelWithProjection`, or `CLIPTextModel` with `projection=False` (hyper-parameters as
    `CLIPTextConfig`); see the module doc."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 2
    dtype: Dtype = jnp.float32  # compute dtype; LayerNorms, attention logits and softmax stay float32
    param_dtype: Dtype = jnp.float32
    scan_layers: bool = True  # the layers as one lax.scan (scan.py: one compile, not one per layer); False: a loop
    projection: bool = True  # pooled through `text_projection` (WithProjection); False: `CLIPTextModel`'s pooler_output

    def dummy_inputs(self, batch: int = 1, length: int = 1) -> tuple[jax.Array]:
        """Zero ids [batch, length], for `init`/`eval_shape`."""
        return (jnp.zeros((batch, length), jnp.int32),)

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array | None = None, hidden_layer: int | None = -2):
        """ids [B, L], mask [B, L] or None -> (hidden [B, L, D], pooled [B, P]), both float32 (module doc)."""
        n, length = self.num_hidden_layers, ids.shape[1]
        if hidden_layer is not None and not -(n + 1) <= hidden_layer <= n:
            raise ValueError(f"hidden_layer={hidden_layer} indexes none of the {n + 1} hidden states (embeddings + {n} layers)")
        if length > self.max_position_embeddings:
            raise ValueError(f"{length} tokens exceed max_position_embeddings={self.max_position_embeddings}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of {list(ACTIVATIONS)}")
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        embed = functools.partial(nn.Embed, features=self.hidden_size, **kw)
        x = embed(self.vocab_size, name="token_embedding")(ids)
        x = x + embed(self.max_position_embeddings, name="position_embedding")(jnp.arange(length)[None])

        keep = None if hidden_layer is None else hidden_layer % (n + 1)
        hidden = x if keep == 0 else None
        layer = functools.partial(CLIPEncoderLayer, self.num_attention_heads, self.intermediate_size, self.hidden_act,
                                  self.layer_norm_eps, **kw)
        for start, stop in ((0, keep), (keep, n)) if keep else ((0, n),):  # split where the kept hidden state is
            if self.is_initializing() or not self.scan_layers or stop - start == 1:
                for i in range(start, stop):
                    x = layer(name=f"layers_{i}")(x, mask)
            else:  # one compiled layer for the run (scan.py)
                unbound = layer(parent=None)
                x = scan_layers(self.variables, [f"layers_{i}" for i in range(start, stop)],
                                lambda v, h: unbound.apply(v, h, mask), x)
            if keep == stop:
                hidden = x

        final_norm = _layer_norm(self.layer_norm_eps, self.param_dtype, "final_layer_norm")
        eos = x[jnp.arange(x.shape[0]), eos_positions(ids, self.eos_token_id)]  # [B, D]; the norm is per token
        pooled = final_norm(eos)
        if self.projection:
            pooled = nn.Dense(self.projection_dim, use_bias=False, name="text_projection", **kw)(pooled)
        if hidden is None:
            hidden = final_norm(x)
        return hidden.astype(jnp.float32), pooled.astype(jnp.float32)


def config_from_json(config: Mapping[str, Any], **overrides) -> CLIPTextEncoder:
    """A `CLIPTextEncoder` from a transformers `CLIPTextConfig` dict (`config.json`). Keys outside `HPARAMS`
    (architectures, dtype, dropouts, initializer_*, bos/pad ids, ...) do not change the forward and are ignored."""
    if "text_config" in config or config.get("model_type", "clip_text_model") != "clip_text_model":
        raise convert.ConversionError(
            f"config model_type={config.get('model_type')!r} is not a CLIP text model ('clip_text_model'): point to a "
            f"CLIPTextModelWithProjection folder such as SD3's text_encoder/ or text_encoder_2/"
        )
    missing = [k for k in HPARAMS if k not in config]
    if missing:
        raise convert.ConversionError(f"CLIP text config lacks required keys {missing}")
    if config["hidden_act"] not in ACTIVATIONS:
        raise convert.ConversionError(f"hidden_act={config['hidden_act']!r} is not supported; use one of {list(ACTIVATIONS)}")
    overrides.setdefault("projection", "CLIPTextModel" not in (config.get("architectures") or []))  # FLUX's text_encoder/
    return CLIPTextEncoder(**{k: config[k] for k in HPARAMS}, **overrides)


def from_state_dict(model: CLIPTextEncoder, state_dict: Mapping[str, Any]) -> dict:
    """A transformers `CLIPTextModelWithProjection` state_dict ({name: array-like}) -> our params (`model.param_dtype`).
    Linear `weight [out, in]` is our `kernel [in, out]`; the `position_ids` buffer is ignored."""
    if not any(str(k).startswith("text_model.") for k in state_dict):  # transformers 5 saves a CLIPTextModel without
        state_dict = {f"text_model.{k}": v for k, v in state_dict.items()}  # its wrapper's prefix; older files have it
    abstract = convert.flat_abstract_params(model, *model.dummy_inputs())
    return convert.convert_tree(abstract, state_dict, transformers_key,
                                transform=lambda path, value: value.T if path.endswith("/kernel") else value,
                                dtype=model.param_dtype, ignored=lambda key: key == _POSITION_IDS_KEY,
                                what="CLIPTextEncoder")


def load(folder: str, **overrides) -> tuple[CLIPTextEncoder, dict]:
    """A transformers CLIP text folder (`config.json` + safetensors, sharded or not; `CLIPTextModelWithProjection` or,
    pooled unprojected, `CLIPTextModel`) -> (model, params); `overrides` set module fields such as `dtype`. No torch."""
    return convert.load_folder(folder, config_from_json, from_state_dict,
                               "a transformers CLIPTextModelWithProjection folder", stem="model", **overrides)
