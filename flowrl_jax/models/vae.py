"""SD3/SD3.5's 16-channel VAE in Flax linen (NHWC): a port of diffusers' `AutoencoderKL`.

    vae, params = load("path/to/sd3.5-medium")                          # pipeline folder or its vae/
    mean, logvar = vae.apply({"params": params}, images, method="encode")
    latents = to_dit_latents(vae, mean)                                  # what the DiT is trained on
    images = vae.apply({"params": params}, from_dit_latents(vae, latents), method="decode")

Shapes (f = 2 ** (len(block_out_channels) - 1), 8 for SD3):
    images       [B, H, W, in_channels]             in [-1, 1] (decode: [B, H, W, out_channels])
    mean, logvar [B, H/f, W/f, latent_channels]     the diagonal Gaussian posterior (logvar clamped
                                                    to [-30, 20] as `DiagonalGaussianDistribution`)
    latents      [B, H/f, W/f, latent_channels]     `(mean - shift_factor) * scaling_factor`

Module and parameter names mirror the diffusers state_dict (`encoder/down_blocks_0/resnets_1/conv1/kernel`
is `encoder.down_blocks.0.resnets.1.conv1.weight`), so `diffusers_key` is three regexes. Layouts: a
conv `kernel [kh, kw, I, O]` is torch's `weight [O, I, kh, kw]`, a dense `kernel [in, out]` its
`weight.T`. Group norms run in float32 whatever `dtype` is. Dropout (0 in every VAE) is left out.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowrl_jax.models import convert
from flowrl_jax.models.attention import xla_attention as attention

Dtype = Any

HPARAMS = (
    "in_channels", "out_channels", "down_block_types", "up_block_types", "block_out_channels", "layers_per_block",
    "act_fn", "latent_channels", "norm_num_groups", "scaling_factor", "shift_factor", "use_quant_conv",
    "use_post_quant_conv", "mid_block_add_attention",
)
# config.json keys that do not change encode/decode: the tiling size and the fp16 advice of pipelines.
_IGNORED_CONFIG = ("sample_size", "force_upcast")
# Per-channel latent statistics, used by some pipelines (SDXL) instead of shift/scale; SD3 sets them null.
_STATS_CONFIG = ("latents_mean", "latents_std")

_GROUP_NORM_EPS = 1e-6  # every norm of diffusers' Encoder/Decoder (resnet_eps, conv_norm_out, attention)
_LOGVAR_RANGE = (-30.0, 20.0)  # DiagonalGaussianDistribution's clamp
_ACTIVATIONS = {"silu": nn.silu, "swish": nn.silu}


# ----------------------------------------------------------------------------- layers


class GroupNorm(nn.Module):
    """`torch.nn.GroupNorm(groups, C, eps=1e-6)` over [B, H, W, C] (stats per sample and group over
    H, W and the group's channels), computed in float32, returned in the input dtype."""

    groups: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        if c % self.groups:
            raise ValueError(f"GroupNorm: {c} channels are not divisible by norm_num_groups={self.groups}")
        scale = self.param("scale", nn.initializers.ones, (c,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (c,), self.param_dtype)
        g = x.astype(jnp.float32).reshape(b, h, w, self.groups, c // self.groups)
        mean = g.mean((1, 2, 4), keepdims=True)
        var = jnp.square(g - mean).mean((1, 2, 4), keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + _GROUP_NORM_EPS)).reshape(b, h, w, c)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class _Layers(nn.Module):
    """Shared fields of every VAE layer: norm groups, activation, dtypes, and the conv/norm factories."""

    groups: int
    act_fn: str
    dtype: Dtype
    param_dtype: Dtype

    def conv(self, features: int, size: int = 3, **kwargs) -> nn.Conv:
        """A `size x size` conv, same-padded unless `padding` is given (kernel [kh, kw, I, O])."""
        kwargs.setdefault("padding", size // 2)
        return nn.Conv(features, (size, size), dtype=self.dtype, param_dtype=self.param_dtype, **kwargs)

    def norm(self, name: str) -> GroupNorm:
        return GroupNorm(self.groups, self.param_dtype, name=name)

    def act(self, x: jax.Array) -> jax.Array:
        return _ACTIVATIONS[self.act_fn](x)

    @property
    def layer_kw(self) -> dict:
        return dict(groups=self.groups, act_fn=self.act_fn, dtype=self.dtype, param_dtype=self.param_dtype)


class ResnetBlock2D(_Layers):
    """diffusers `ResnetBlock2D` without time embedding: `shortcut(x) + conv2(act(norm2(conv1(act(norm1(x))))))`,
    shortcut a 1x1 conv when the width changes. [B, H, W, C] -> [B, H, W, out_channels]."""

    out_channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv(self.out_channels, name="conv1")(self.act(self.norm("norm1")(x)))
        h = self.conv(self.out_channels, name="conv2")(self.act(self.norm("norm2")(h)))
        if x.shape[-1] != self.out_channels:
            x = self.conv(self.out_channels, 1, name="conv_shortcut")(x)
        return x + h


class SpatialAttention(_Layers):
    """The VAE mid-block attention (diffusers `Attention(_from_deprecated_attn_block=True)` with
    `AttnProcessor2_0`): one head of width C over the H*W pixels of a group-normed input, plus the
    residual (rescale_output_factor is 1 in the VAE). [B, H, W, C] -> [B, H, W, C]."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        tokens = self.norm("group_norm")(x).reshape(b, h * w, 1, c)  # [B, S, heads=1, C]
        dense = functools.partial(nn.Dense, c, dtype=self.dtype, param_dtype=self.param_dtype)
        q, k, v = (dense(name=name)(tokens) for name in ("to_q", "to_k", "to_v"))
        out = dense(name="to_out")(attention(q, k, v))
        return x + out.reshape(b, h, w, c)


class MidBlock2D(_Layers):
    """diffusers `UNetMidBlock2D` (num_layers=1): resnet, optional attention, resnet. [B, H, W, C] -> same."""

    add_attention: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        x = ResnetBlock2D(out_channels=c, name="resnets_0", **self.layer_kw)(x)
        if self.add_attention:
            x = SpatialAttention(name="attentions_0", **self.layer_kw)(x)
        return ResnetBlock2D(out_channels=c, name="resnets_1", **self.layer_kw)(x)


class Downsample2D(_Layers):
    """diffusers `Downsample2D(use_conv=True, padding=0)`: zero-pad bottom/right by 1, 3x3 stride-2 conv.
    [B, H, W, C] -> [B, H/2, W/2, C] (H, W even)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return self.conv(x.shape[-1], strides=2, padding="VALID", name="conv")(x)


class Upsample2D(_Layers):
    """diffusers `Upsample2D(use_conv=True)`: nearest-neighbour x2, 3x3 conv. [B, H, W, C] -> [B, 2H, 2W, C]."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x.shape[-1], name="conv")(x)


class DownEncoderBlock2D(_Layers):
    """diffusers `DownEncoderBlock2D`: `num_layers` resnets, then (`add_downsample`) a `Downsample2D`.
    [B, H, W, C] -> [B, H/2, W/2, out_channels] (H, W kept without the downsample)."""

    out_channels: int
    num_layers: int
    add_downsample: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.num_layers):
            x = ResnetBlock2D(out_channels=self.out_channels, name=f"resnets_{j}", **self.layer_kw)(x)
        if self.add_downsample:
            x = Downsample2D(name="downsamplers_0", **self.layer_kw)(x)
        return x


class UpDecoderBlock2D(_Layers):
    """diffusers `UpDecoderBlock2D`: `num_layers` resnets, then (`add_upsample`) an `Upsample2D`.
    [B, H, W, C] -> [B, 2H, 2W, out_channels] (H, W kept without the upsample)."""

    out_channels: int
    num_layers: int
    add_upsample: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.num_layers):
            x = ResnetBlock2D(out_channels=self.out_channels, name=f"resnets_{j}", **self.layer_kw)(x)
        if self.add_upsample:
            x = Upsample2D(name="upsamplers_0", **self.layer_kw)(x)
        return x


class Encoder(_Layers):
    """diffusers `Encoder` (double_z): [B, H, W, in_channels] -> [B, H/f, W/f, 2 latent_channels]."""

    block_out_channels: Sequence[int]
    layers_per_block: int
    latent_channels: int
    add_attention: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = tuple(self.block_out_channels)
        x = self.conv(channels[0], name="conv_in")(x)
        for i, c in enumerate(channels):
            x = DownEncoderBlock2D(out_channels=c, num_layers=self.layers_per_block, add_downsample=i < len(channels) - 1,
                                   name=f"down_blocks_{i}", **self.layer_kw)(x)
        x = MidBlock2D(add_attention=self.add_attention, name="mid_block", **self.layer_kw)(x)
        x = self.act(self.norm("conv_norm_out")(x))
        return self.conv(2 * self.latent_channels, name="conv_out")(x)


class Decoder(_Layers):
    """diffusers `Decoder` (group norm): up blocks over reversed(block_out_channels), each with
    layers_per_block + 1 resnets. [B, h, w, latent_channels] -> [B, f h, f w, out_channels]."""

    block_out_channels: Sequence[int]
    layers_per_block: int
    out_channels: int
    add_attention: bool

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        channels = tuple(reversed(tuple(self.block_out_channels)))
        x = self.conv(channels[0], name="conv_in")(z)
        x = MidBlock2D(add_attention=self.add_attention, name="mid_block", **self.layer_kw)(x)
        for i, c in enumerate(channels):
            x = UpDecoderBlock2D(out_channels=c, num_layers=self.layers_per_block + 1, add_upsample=i < len(channels) - 1,
                                 name=f"up_blocks_{i}", **self.layer_kw)(x)
        x = self.act(self.norm("conv_norm_out")(x))
        return self.conv(self.out_channels, name="conv_out")(x)


# ----------------------------------------------------------------------------- the autoencoder


class AutoencoderKL(nn.Module):
    """diffusers `AutoencoderKL` (fields and defaults as its `__init__`); `encode`/`decode` (module doc).
    `__call__` (encode, then decode the mean) exists so that `init` creates every parameter."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: Sequence[str] = ("DownEncoderBlock2D",)
    up_block_types: Sequence[str] = ("UpDecoderBlock2D",)
    block_out_channels: Sequence[int] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None  # None is 0
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    dtype: Dtype = jnp.float32  # compute dtype; group norms are float32 regardless
    param_dtype: Dtype = jnp.float32

    def setup(self):
        n = len(self.block_out_channels)
        for field, types, supported in (("down_block_types", self.down_block_types, "DownEncoderBlock2D"),
                                        ("up_block_types", self.up_block_types, "UpDecoderBlock2D")):
            if any(t != supported for t in types) or len(types) != n:
                raise ValueError(f"{field}={tuple(types)}: only {n} x {supported!r} (one per block_out_channels entry) "
                                 f"is supported, the blocks of SD/SDXL/SD3 VAEs")
        if self.act_fn not in _ACTIVATIONS:
            raise ValueError(f"act_fn={self.act_fn!r} is not supported; use one of {list(_ACTIVATIONS)}")
        kw = dict(groups=self.norm_num_groups, act_fn=self.act_fn, dtype=self.dtype, param_dtype=self.param_dtype,
                  block_out_channels=tuple(self.block_out_channels), layers_per_block=self.layers_per_block,
                  add_attention=self.mid_block_add_attention)
        self.encoder = Encoder(latent_channels=self.latent_channels, **kw)
        self.decoder = Decoder(out_channels=self.out_channels, **kw)
        conv = functools.partial(nn.Conv, kernel_size=(1, 1), dtype=self.dtype, param_dtype=self.param_dtype)
        self.quant_conv = conv(2 * self.latent_channels) if self.use_quant_conv else None
        self.post_quant_conv = conv(self.latent_channels) if self.use_post_quant_conv else None

    def encode(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, H, W, in_channels] in [-1, 1] -> (mean, logvar) [B, H/f, W/f, latent_channels], float32."""
        moments = self.encoder(images.astype(self.dtype))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
        return mean, jnp.clip(logvar, *_LOGVAR_RANGE)

    def decode(self, z: jax.Array) -> jax.Array:
        """[B, h, w, latent_channels] (VAE latent space, see `from_dit_latents`) -> [B, f h, f w, out_channels], float32."""
        z = z.astype(self.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z).astype(jnp.float32)

    def __call__(self, images: jax.Array) -> jax.Array:
        mean, _ = self.encode(images)
        return self.decode(mean)

    def dummy_images(self, batch: int = 1) -> jax.Array:
        """Zeros [batch, s, s, in_channels] with s = 2 f, the smallest size each downsample halves exactly."""
        size = 2 ** len(self.block_out_channels)
        return jnp.zeros((batch, size, size, self.in_channels), jnp.float32)


def to_dit_latents(vae: AutoencoderKL, mean: jax.Array) -> jax.Array:
    """Encoder mean -> the DiT's latents: `(mean - shift_factor) * scaling_factor` (diffusers' SD3 training
    scripts and `StableDiffusion3Pipeline` image-to-image)."""
    return (mean - (vae.shift_factor or 0.0)) * vae.scaling_factor


def from_dit_latents(vae: AutoencoderKL, latents: jax.Array) -> jax.Array:
    """The DiT's latents -> the decoder input: `latents / scaling_factor + shift_factor` (what
    `StableDiffusion3Pipeline` decodes); the inverse of `to_dit_latents`."""
    return latents / vae.scaling_factor + (vae.shift_factor or 0.0)


# ----------------------------------------------------------------------------- diffusers weights


def config_from_json(config: Mapping[str, Any], **overrides) -> AutoencoderKL:
    """An `AutoencoderKL` from a diffusers `vae/config.json` dict. Metadata (`_`-prefixed), `sample_size`
    and `force_upcast` are ignored; `latents_mean`/`latents_std` must be null (per-channel statistics
    replace shift/scale in the pipelines that set them); any other unknown key is an error."""
    unknown = sorted(k for k in config if not k.startswith("_") and k not in HPARAMS + _IGNORED_CONFIG + _STATS_CONFIG)
    if unknown:
        raise convert.ConversionError(f"VAE config.json has keys AutoencoderKL does not know: {unknown}; known: {list(HPARAMS)}")
    stats = [k for k in _STATS_CONFIG if config.get(k) is not None]
    if stats:
        raise convert.ConversionError(f"VAE config.json sets {stats}: per-channel latent statistics are not supported, "
                                      "only scaling_factor/shift_factor (SD3)")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in HPARAMS}
    return AutoencoderKL(**{**kwargs, **overrides})


def diffusers_key(flax_path: str) -> str:
    """'encoder/down_blocks_0/downsamplers_0/conv/kernel' -> 'encoder.down_blocks.0.downsamplers.0.conv.weight'."""
    key = re.sub(r"_(\d+)/", r".\1/", flax_path)
    key = re.sub(r"/to_out/", "/to_out.0/", key)
    key = re.sub(r"/(kernel|scale)$", "/weight", key)
    return key.replace("/", ".")


def _to_flax_layout(path: str, value):
    """torch conv `[O, I, kh, kw]` -> `[kh, kw, I, O]`; linear `[out, in]` -> `[in, out]`."""
    if not path.endswith("/kernel"):
        return value
    return value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T


def from_state_dict(model: AutoencoderKL, state_dict: Mapping[str, Any]) -> dict:
    """A diffusers `AutoencoderKL` state_dict ({name: array-like}) -> our `params` (in `model.param_dtype`);
    a `ConversionError` lists every unknown, missing or mis-shaped key."""
    abstract = convert.flat_abstract_params(model, model.dummy_images())
    return convert.convert_tree(abstract, state_dict, diffusers_key, _to_flax_layout, model.param_dtype, what="AutoencoderKL")


def load(path: str, **overrides) -> tuple[AutoencoderKL, dict]:
    """A diffusers VAE folder (`config.json` + `diffusion_pytorch_model.safetensors` or its sharded
    `.index.json`), or a pipeline folder holding `vae/` -> (model, params). No torch import."""
    return convert.load_folder(path, config_from_json, from_state_dict,
                               "a diffusers AutoencoderKL folder or a pipeline folder with vae/", "vae", **overrides)
