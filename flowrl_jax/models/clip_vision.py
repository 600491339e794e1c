"""The CLIP image tower (PickScore, CLIPScore, the LAION aesthetic predictor's ViT): a Flax linen port of transformers'
`CLIPVisionModelWithProjection` (= `CLIPModel.vision_model` + `visual_projection`), weights loaded without torch.

    model, params = load("clip-vit-large-patch14-vision")           # a CLIPVisionModelWithProjection folder
    params = from_state_dict(model, state_dict)                     # `vision_model.*` + `visual_projection.weight`
    image_embeds = model.apply({"params": params}, pixel_values)    # [B, S, S, 3] -> [B, P] float32
    shardings = parallel.tree_shardings(params, mesh, PARTITION_RULES)

Shapes (B batch, S = image_size, p = patch_size, N = (S // p)^2 patches, D hidden_size, P projection_dim):
    pixel_values  [B, S, S, C] float NHWC, already normalised (`clip.CLIP.preprocess` or CLIPImageProcessor's output
                  moved to channels-last)
    image_embeds  [B, P] float32  transformers' `image_embeds` / `get_image_features`: the post-LayerNormed CLS token
                  times `visual_projection`, not normalised

The forward: patch embedding (a stride-p conv without bias, here the equal dense layer over `patchify`'d pixels),
[CLS] + patches, + position embedding, `pre_layrnorm` (transformers' spelling), the encoder layers (`clip_text`'s
`CLIPEncoderLayer` with full, non-causal attention), `post_layernorm` on the CLS token, `visual_projection` (no bias).
As in transformers, pixels past the last whole patch are dropped (the conv's stride) and the input size must equal
`image_size` (no position interpolation). Dtypes as in `clip_text`: `dtype` is the matmul and residual dtype, the
LayerNorms, attention logits and softmax stay float32, the output is float32.

`remat=True` rematerializes every layer in the backward pass, scanned over the layers' stacked parameters as the
MMDiT does (an unrolled chain of checkpointed blocks saves nothing under XLA:CPU's scheduler; WORKSPACE_NOTES.md, the
memory plan). It costs one stacked copy of the layers' weights per call (sharded like them); the parameter tree is
the same either way.

Parameter paths mirror the transformers state_dict (`layers_3/self_attn/q_proj/kernel` for
`vision_model.encoder.layers.3.self_attn.q_proj.weight`), so `transformers_key` is a short table.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowrl_jax.models import clip_text, convert
from flowrl_jax.models.mmdit import patchify
from flowrl_jax.models.scan import scan_layers

Dtype = Any

# FSDP for ViT-H/14's ~630M parameters: every kernel (patch embedding, q/k/v/out, fc1/fc2, projection) and the position
# table [N + 1, D] shard their largest divisible dim over `fsdp`; LayerNorms, biases and the class embedding [D] are tiny.
# Unanchored, so the rules also fit the tower under a prefix (`clip.PARTITION_RULES`' "vision/...").
PARTITION_RULES = (
    (r"(/kernel|position_embedding/embedding)$", "fsdp"),
    (r".*", "replicate"),
)

HPARAMS = (
    "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers", "num_attention_heads", "num_channels",
    "image_size", "patch_size", "hidden_act", "layer_norm_eps",
)
_POSITION_IDS_KEY = "vision_model.embeddings.position_ids"  # a buffer (arange) in older checkpoints, not a parameter

# Our path (with "/") -> transformers key, applied in order; then "/" -> ".".
_FLAX_TO_TRANSFORMERS = (
    (r"^(class_embedding)$", r"vision_model/embeddings/\1"),
    (r"^(patch|position)_embedding/", r"vision_model/embeddings/\1_embedding/"),
    (r"^layers_(\d+)/", r"vision_model/encoder/layers.\1/"),
    (r"^(pre_layrnorm|post_layernorm)/", r"vision_model/\1/"),
    (r"/(kernel|scale|embedding)$", "/weight"),
)


def transformers_key(flax_path: str) -> str:
    """'layers_0/mlp/fc1/kernel' -> 'vision_model.encoder.layers.0.mlp.fc1.weight'."""
    key = flax_path
    for pattern, repl in _FLAX_TO_TRANSFORMERS:
        key = re.sub(pattern, repl, key)
    return key.replace("/", ".")


class CLIPVisionEncoder(nn.Module):
    """transformers `CLIPVisionModelWithProjection` (hyper-parameters as `CLIPVisionConfig`); see the module doc."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    dtype: Dtype = jnp.float32  # compute dtype; LayerNorms, attention logits and softmax stay float32
    param_dtype: Dtype = jnp.float32
    remat: bool = False  # rematerialize each layer in the backward pass (a scan of jax.checkpoint over the layers)

    @property
    def grid(self) -> int:
        """Patches per side: the conv's output size, floor(image_size / patch_size)."""
        return self.image_size // self.patch_size

    def dummy_inputs(self, batch: int = 1) -> tuple[jax.Array]:
        """Zero pixels [batch, S, S, C], for `init`/`eval_shape`."""
        return (jnp.zeros((batch, self.image_size, self.image_size, self.num_channels), jnp.float32),)

    def _layer(self, name: str | None = None, parent: Any = "auto") -> clip_text.CLIPEncoderLayer:
        kw = {} if parent == "auto" else {"parent": parent}
        return clip_text.CLIPEncoderLayer(self.num_attention_heads, self.intermediate_size, self.hidden_act,
                                          self.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype,
                                          causal=False, name=name, **kw)

    def _scanned_layers(self, x: jax.Array) -> jax.Array:
        """All layers as one `lax.scan` of a rematerialized layer (`scan.scan_layers`)."""
        layer = self._layer(parent=None)
        names = [f"layers_{i}" for i in range(self.num_hidden_layers)]
        return scan_layers(self.variables, names, lambda v, h: layer.apply(v, h, None), x, remat=True)

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, S, S, C] -> image_embeds [B, P] float32 (module doc)."""
        b, height, width, channels = pixel_values.shape
        if (height, width, channels) != (self.image_size, self.image_size, self.num_channels):
            raise ValueError(f"pixel_values of shape {pixel_values.shape} do not fit this CLIP vision model: expected "
                             f"[B, {self.image_size}, {self.image_size}, {self.num_channels}] (NHWC)")
        if self.hidden_act not in clip_text.ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of {list(clip_text.ACTIVATIONS)}")
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        g, p, dim = self.grid, self.patch_size, self.hidden_size

        # The stride-p conv [D, C, p, p] == a dense [p*p*C, D] over the patchified pixels (whole patches only).
        patches = patchify(pixel_values[:, :g * p, :g * p], p)  # [B, N, p*p*C]
        x = nn.Dense(dim, use_bias=False, name="patch_embedding", **kw)(patches)
        cls = self.param("class_embedding", nn.initializers.normal(1.0), (dim,), self.param_dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, dim)), x], axis=1)  # [B, N + 1, D]
        x = x + nn.Embed(g * g + 1, dim, name="position_embedding", **kw)(jnp.arange(g * g + 1)[None])
        x = clip_text._layer_norm(self.layer_norm_eps, self.param_dtype, "pre_layrnorm")(x).astype(self.dtype)

        if self.remat and not self.is_initializing():
            x = self._scanned_layers(x)
        else:
            for i in range(self.num_hidden_layers):
                x = self._layer(name=f"layers_{i}")(x, None)

        pooled = clip_text._layer_norm(self.layer_norm_eps, self.param_dtype, "post_layernorm")(x[:, 0])  # CLS
        embeds = nn.Dense(self.projection_dim, use_bias=False, name="visual_projection", **kw)(pooled)
        return embeds.astype(jnp.float32)


def _image_size(value) -> int:
    """`image_size` as an int: configs may hold [S, S]; a non-square size is not a CLIP checkpoint we know."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise convert.ConversionError(f"image_size={value} is not square; CLIP vision models take square images")
        value = value[0]
    return int(value)


def config_from_json(config: Mapping[str, Any], **overrides) -> CLIPVisionEncoder:
    """A `CLIPVisionEncoder` from a transformers `CLIPVisionConfig` dict (a `CLIPVisionModelWithProjection` folder's
    `config.json`, or a CLIPModel's `vision_config` with the top-level `projection_dim` filled in by `clip`). Keys
    outside `HPARAMS` (dropouts, initializer_*, ...) do not change the forward and are ignored."""
    if "vision_config" in config or config.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise convert.ConversionError(
            f"config model_type={config.get('model_type')!r} is not a CLIP vision model ('clip_vision_model'): point to "
            f"a CLIPVisionModelWithProjection folder, or load a CLIPModel folder with clip.load_clip"
        )
    missing = [k for k in HPARAMS if k not in config]
    if missing:
        raise convert.ConversionError(f"CLIP vision config lacks required keys {missing}")
    if config["hidden_act"] not in clip_text.ACTIVATIONS:
        raise convert.ConversionError(
            f"hidden_act={config['hidden_act']!r} is not supported; use one of {list(clip_text.ACTIVATIONS)}")
    kwargs = {k: config[k] for k in HPARAMS}
    kwargs["image_size"] = _image_size(kwargs["image_size"])
    kwargs["patch_size"] = _image_size(kwargs["patch_size"])
    return CLIPVisionEncoder(**kwargs, **overrides)


def from_state_dict(model: CLIPVisionEncoder, state_dict: Mapping[str, Any]) -> dict:
    """A transformers `CLIPVisionModelWithProjection` state_dict ({name: array-like}; a CLIPModel's `vision_model.*` +
    `visual_projection.weight`) -> our params (`model.param_dtype`, host numpy). Linear `weight [out, in]` is our
    `kernel [in, out]`; the patch conv `weight [D, C, p, p]` our dense `kernel [p*p*C, D]` (patchify order p, p, C);
    the `position_ids` buffer is ignored."""
    p, c = model.patch_size, model.num_channels

    def transform(path, value):
        if path == "patch_embedding/kernel" and value.ndim == 4:
            return value.transpose(2, 3, 1, 0).reshape(p * p * c, -1)
        return value.T if path.endswith("/kernel") else value

    abstract = convert.flat_abstract_params(model, *model.dummy_inputs())
    return convert.convert_tree(abstract, state_dict, transformers_key, transform=transform, dtype=model.param_dtype,
                                ignored=lambda key: key == _POSITION_IDS_KEY, what="CLIPVisionEncoder")


def load(folder: str, **overrides) -> tuple[CLIPVisionEncoder, dict]:
    """A transformers `CLIPVisionModelWithProjection` folder (`config.json` + safetensors, sharded or not) ->
    (model, params); `overrides` set module fields such as `dtype` or `remat`. No torch import. For a whole CLIPModel
    folder (both towers, PickScore) use `clip.load_clip`."""
    return convert.load_folder(folder, config_from_json, from_state_dict,
                               "a transformers CLIPVisionModelWithProjection folder", stem="model", **overrides)
