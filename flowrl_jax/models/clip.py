"""A whole transformers `CLIPModel` folder (PickScore, CLIPScore's ViT, the aesthetic predictor's ViT) without torch:
both towers (`clip_text`, `clip_vision`), the logit scale, the image settings of its processor and its tokenizer.

    clip, params = load_clip("PickScore_v1", processor_folder="CLIP-ViT-H-14-laion2B-s32B-b79K")
    ids = clip.tokenize(["a photo of a cat"])                       # [B, L] int32, host numpy
    text = clip.text_embeds(params, ids)                            # [B, P] float32
    image = clip.image_embeds(params, clip.preprocess(images))      # images [B, H, W, 3] in [-1, 1]; differentiable
    cos = jnp.sum(unit(image) * unit(text), -1)                     # unit(v) = v / |v|: CLIPScore's cosine
    pickscore = jnp.exp(params["logit_scale"]) * cos                # transformers' logits_per_image diagonal

`params` = {"text": ..., "vision": ..., "logit_scale": float32 0-d array (the raw parameter; exp() is the scale)}, host
numpy in the model's `param_dtype` (logit_scale always float32): placing them is the caller's (`PARTITION_RULES`).

The folder: `config.json` (model_type "clip", with `text_config`, `vision_config`, `projection_dim`) and
`model.safetensors` or a sharded `model.safetensors.index.json` (keys `text_model.*`, `text_projection.weight`,
`vision_model.*`, `visual_projection.weight`, `logit_scale`). A folder holding only `pytorch_model.bin` (PickScore_v1
on the hub) needs one conversion, with torch: `python -m flowrl_jax.models.clip convert-bin FOLDER`.
The processor folder (the model folder unless `processor_folder` is given; flow_grpo's PickScore takes laion's
CLIP-ViT-H-14 processor with PickScore_v1's weights) holds the image settings, read as transformers 5 reads them: the
`image_processor` entry of `processor_config.json` (what transformers 5's `save_pretrained` writes) or else
`preprocessor_config.json` (hub snapshots), and the tokenizer files (`AutoTokenizer`, local files only).

`CLIP.preprocess` is `CLIPImageProcessor`'s pixel path in the graph: [-1, 1] -> [0, 1], resize so the shortest edge is
`shortest_edge` (the long edge int(shortest_edge * long / short), as transformers), centre crop, rescale, normalise.
The resize is `jax.image.resize` with antialiasing, the algorithm of PIL's resampling (PIL widens the kernel by the
downscale factor and renormalises it at the borders; PIL's BICUBIC is Keys' cubic with a = -0.5, as JAX's "cubic"),
and like PIL it resizes in two passes, horizontal first, saturating each at [0, 1] (PIL's uint8 intermediate). The
remaining differences from the processor on uint8 images are PIL's roundings to uint8 (the input, after the horizontal
pass, at the end: about one uint8 level) and its fixed-point weights; tests/test_clip.py bounds them as a score
difference.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models import clip_text, clip_vision, convert

# FSDP for both towers under the `params` tree ("text/...", "vision/..."): kernels, the token embedding [V, D] and the
# position tables shard their largest divisible dim over `fsdp`; LayerNorms, biases, the class embedding and
# logit_scale are replicated.
PARTITION_RULES = (
    (r"(/kernel|(token|position)_embedding/embedding)$", "fsdp"),
    (r".*", "replicate"),
)

CONVERT_COMMAND = "python -m flowrl_jax.models.clip convert-bin {folder}"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_BIN = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_IMAGE_CONFIGS = ("processor_config.json", "preprocessor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # a fast tokenizer's file, or a slow CLIP tokenizer's vocab + merges
# PIL resample codes (`PILImageResampling`) -> jax.image.resize methods computing the same filter with antialiasing.
_RESAMPLE = {3: "bicubic", 2: "bilinear", 1: "lanczos3"}
_RESAMPLE_NAMES = {"bicubic": "cubic", "bilinear": "linear", "lanczos3": "lanczos3"}
# transformers 5's defaults for keys that older configs (written as diffs from the defaults) may leave out.
_TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                      eos_token_id=49407)
_VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
_OPENAI_MEAN, _OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """A CLIPImageProcessor's pixel path (`preprocess`). Skipped steps: `shortest_edge=None` and `size=None` (no resize),
    `crop=None` (no centre crop), `mean=(0,)*3, std=(1,)*3` (no normalisation)."""

    shortest_edge: int | None = 224  # resize so the shorter side has this length (transformers' size.shortest_edge)
    crop: tuple[int, int] | None = (224, 224)  # centre crop (height, width)
    mean: tuple[float, ...] = _OPENAI_MEAN
    std: tuple[float, ...] = _OPENAI_STD
    resample: str = "bicubic"  # a key of _RESAMPLE_NAMES
    rescale: float = 1.0  # the value of white after rescaling: 255 * rescale_factor (1.0), or 255 when do_rescale is off
    size: tuple[int, int] | None = None  # resize to exactly (height, width) instead (size.height/width processors)

    def resized_shape(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize, as transformers computes it (the long side truncated)."""
        if self.size is not None:
            return self.size
        if self.shortest_edge is None:
            return height, width
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if height <= width else (new_long, self.shortest_edge)


@dataclasses.dataclass(frozen=True, eq=False)
class CLIP:
    """Modules and settings of a CLIPModel folder, no weights (`load_clip`); hashable by identity, so it can be a
    static argument. Every method but `tokenize` is pure and jittable."""

    text: clip_text.CLIPTextEncoder
    vision: clip_vision.CLIPVisionEncoder
    image: ImageSettings
    tokenizer: Any
    max_length: int

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> [B, max_length] int32 ids (host numpy): padded to max_length, truncated (with the EOS kept), as
        transformers' CLIP pipelines tokenize; no mask is needed (causal attention: padding after EOS changes no
        `text_embeds`)."""
        if isinstance(texts, str):
            raise TypeError("tokenize takes a list of texts, not one string")
        out = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="np")
        return np.asarray(out["input_ids"], np.int32)

    def image_embeds(self, params: Mapping[str, Any], pixel_values: jax.Array) -> jax.Array:
        """pixel_values [B, S, S, 3] (normalised, `preprocess`) -> [B, P] float32 transformers `get_image_features`."""
        return self.vision.apply({"params": params["vision"]}, pixel_values)

    def text_embeds(self, params: Mapping[str, Any], ids: jax.Array) -> jax.Array:
        """ids [B, L] (`tokenize`) -> [B, P] float32 transformers `get_text_features` (unnormalised)."""
        return self.text.apply({"params": params["text"]}, ids, None, hidden_layer=None)[1]

    def preprocess(self, images: jax.Array) -> jax.Array:
        """images [B, H, W, 3] in [-1, 1] (clipped) -> pixel_values [B, S, S, 3] float32 (module doc); differentiable."""
        s = self.image
        x = jnp.clip((images.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)
        b, height, width, c = x.shape
        new_h, new_w = s.resized_shape(height, width)
        # PIL's two passes, horizontal first, each saturating the cubic's over- and undershoot at [0, 255] (its uint8
        # intermediate): one 2-D resize clipped at the end differed by up to 5 uint8 levels at saturated edges.
        method = _RESAMPLE_NAMES[s.resample]
        if new_w != width:
            x = jnp.clip(jax.image.resize(x, (b, height, new_w, c), method, antialias=True), 0.0, 1.0)
        if new_h != height:
            x = jnp.clip(jax.image.resize(x, (b, new_h, new_w, c), method, antialias=True), 0.0, 1.0)
        if s.crop is not None:
            ch, cw = s.crop
            if ch > new_h or cw > new_w:
                raise ValueError(f"images of {height}x{width} resize to {new_h}x{new_w}, smaller than the crop {ch}x{cw}")
            top, left = (new_h - ch) // 2, (new_w - cw) // 2
            x = x[:, top:top + ch, left:left + cw]
        x = x * s.rescale
        return (x - jnp.asarray(s.mean, jnp.float32)) / jnp.asarray(s.std, jnp.float32)


# ----------------------------------------------------------------------------- configs


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _tower_config(config: Mapping[str, Any], tower: str, defaults: Mapping[str, Any]) -> dict:
    """`text_config` / `vision_config` with transformers' defaults filled in; a legacy `*_config_dict` wins (as
    transformers' CLIPConfig has it)."""
    merged = {**defaults, **(config.get(f"{tower}_config") or {})}
    if config.get(f"{tower}_config_dict"):
        merged.update({**defaults, **config[f"{tower}_config_dict"]})
    merged["projection_dim"] = config.get("projection_dim", 512)  # the towers' own projection_dim is unused by CLIPModel
    return merged


def _is_clip_config(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "clip" or ("text_config" in config and "vision_config" in config)


def _size(value, what: str) -> tuple[int, int]:
    """A processor size entry (int, {"height", "width"}) -> (height, width)."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, Mapping) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise ValueError(f"{what}={value!r} is neither an int nor {{'height', 'width'}}")


def image_settings_from_json(config: Mapping[str, Any]) -> ImageSettings:
    """A CLIPImageProcessor dict (`preprocessor_config.json`, or `processor_config.json`'s `image_processor`) ->
    ImageSettings, with transformers' CLIPImageProcessor defaults for absent keys."""
    shortest_edge, size = None, None
    if config.get("do_resize", True):
        raw = config.get("size", {"shortest_edge": 224})
        if isinstance(raw, int):  # legacy int: the shortest edge (CLIP's default_to_square=False)
            shortest_edge = raw
        elif isinstance(raw, Mapping) and "shortest_edge" in raw and raw.get("longest_edge") is None:
            shortest_edge = int(raw["shortest_edge"])
        elif isinstance(raw, Mapping) and "height" in raw and "width" in raw:
            size = (int(raw["height"]), int(raw["width"]))
        else:
            raise ValueError(f"image processor size={raw!r} is not supported: use {{'shortest_edge'}} or "
                             "{'height', 'width'}")
    crop = _size(config.get("crop_size", 224), "crop_size") if config.get("do_center_crop", True) else None
    resample = config.get("resample", 3)
    if resample not in _RESAMPLE:
        raise ValueError(f"image processor resample={resample!r} is not supported: use one of {_RESAMPLE} (PIL codes)")
    if config.get("do_normalize", True):
        mean, std = config.get("image_mean", _OPENAI_MEAN), config.get("image_std", _OPENAI_STD)
        mean, std = ((v,) * 3 if isinstance(v, (int, float)) else v for v in (mean, std))
    else:
        mean, std = (0.0,) * 3, (1.0,) * 3
    rescale = 255.0 * float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 255.0
    return ImageSettings(shortest_edge=shortest_edge, crop=crop, mean=tuple(float(m) for m in mean),
                         std=tuple(float(v) for v in std), resample=_RESAMPLE[resample], rescale=rescale, size=size)


def _image_config(folder: str) -> dict:
    """The image processor dict of a processor folder, with transformers 5's priority: `processor_config.json`'s
    `image_processor` entry, else `preprocessor_config.json`."""
    processor = os.path.join(folder, "processor_config.json")
    if os.path.isfile(processor):
        nested = _read_json(processor).get("image_processor")
        if nested is not None:
            return nested
    legacy = os.path.join(folder, "preprocessor_config.json")
    if os.path.isfile(legacy):
        return _read_json(legacy)
    raise FileNotFoundError(f"no image processor settings in {folder}: expected processor_config.json (with an "
                            f"'image_processor' entry) or preprocessor_config.json")


# ----------------------------------------------------------------------------- checks and loading


def check_folder(folder: str, flag: str, model: bool = True, processor: bool = False) -> None:
    """Cheap (no weights read) one-line FileNotFoundError / ValueError naming `flag` and the expected files when
    `folder` is no CLIPModel folder (`model`: config.json of model_type "clip" + model.safetensors or its index) or no
    processor folder (`processor`: processor_config.json / preprocessor_config.json + tokenizer files)."""
    if not folder:
        raise ValueError(f"{flag} is empty: set it to a transformers CLIPModel folder")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{flag}={folder}: no such folder (expected a transformers CLIPModel folder)")
    found = sorted(os.listdir(folder))
    if model:
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{flag}={folder} has no config.json (found {found}): expected a transformers "
                                    "CLIPModel folder (config.json + model.safetensors)")
        try:
            config = _read_json(config_path)
        except ValueError as e:
            raise ValueError(f"{flag}={folder}: {e}") from None
        if not _is_clip_config(config):
            raise ValueError(f"{flag}={folder}: config.json has model_type={config.get('model_type')!r}, not a CLIPModel "
                             "('clip', with text_config and vision_config); a CLIPTextModel or CLIPVisionModel folder "
                             "holds one tower only")
        if not any(os.path.isfile(os.path.join(folder, name)) for name in _WEIGHTS):
            if any(os.path.isfile(os.path.join(folder, name)) for name in _BIN):
                raise FileNotFoundError(f"{flag}={folder} holds pytorch_model.bin but no model.safetensors: convert it "
                                        f"once with `{CONVERT_COMMAND.format(folder=folder)}` (needs torch)")
            raise FileNotFoundError(f"{flag}={folder} has no weights (found {found}): expected model.safetensors or "
                                    "model.safetensors.index.json")
    if processor:
        if not any(os.path.isfile(os.path.join(folder, name)) for name in _IMAGE_CONFIGS):
            raise FileNotFoundError(f"{flag}={folder} has no image processor settings (found {found}): expected "
                                    "processor_config.json or preprocessor_config.json")
        if not any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
            raise FileNotFoundError(f"{flag}={folder} has no tokenizer (found {found}): expected tokenizer.json or "
                                    "vocab.json + merges.txt")


def from_state_dict(text: clip_text.CLIPTextEncoder, vision: clip_vision.CLIPVisionEncoder,
                    state_dict: Mapping[str, Any]) -> dict:
    """A transformers CLIPModel state_dict ({name: array-like}) -> params {"text", "vision", "logit_scale"} (host numpy).
    Every key must belong to one tower or be `logit_scale`; each tower names its own unknown/missing keys."""
    is_text = lambda k: k.startswith("text_model.") or k == "text_projection.weight"  # noqa: E731
    is_vision = lambda k: k.startswith("vision_model.") or k == "visual_projection.weight"  # noqa: E731
    other = sorted(k for k in state_dict if not (is_text(k) or is_vision(k) or k == "logit_scale"))
    if other:
        raise convert.ConversionError(f"cannot load weights into CLIPModel: {len(other)} unknown keys (neither tower nor "
                                      f"logit_scale): {other}")
    if "logit_scale" not in state_dict:
        raise convert.ConversionError("cannot load weights into CLIPModel: 1 missing keys: ['logit_scale']")
    return {
        "text": clip_text.from_state_dict(text, {k: v for k, v in state_dict.items() if is_text(k)}),
        "vision": clip_vision.from_state_dict(vision, {k: v for k, v in state_dict.items() if is_vision(k)}),
        "logit_scale": np.asarray(convert._to_numpy(state_dict["logit_scale"]), np.float32).reshape(()),
    }


def load_clip(folder: str, processor_folder: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32,
              remat: bool = False) -> tuple[CLIP, dict]:
    """A transformers CLIPModel folder (+ its processor and tokenizer, or those of `processor_folder`) -> (CLIP, params);
    see the module doc. `remat` applies to the vision tower (the one differentiated through). No torch import."""
    check_folder(folder, "folder")
    check_folder(processor_folder or folder, "processor_folder" if processor_folder else "folder", model=False,
                 processor=True)
    config = _read_json(os.path.join(folder, "config.json"))
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    text = clip_text.config_from_json(_tower_config(config, "text", _TEXT_DEFAULTS), **kw)
    vision = clip_vision.config_from_json(_tower_config(config, "vision", _VISION_DEFAULTS), remat=remat, **kw)
    image = image_settings_from_json(_image_config(processor_folder or folder))
    out_shape = image.crop or image.size
    if out_shape is not None and out_shape != (vision.image_size, vision.image_size):
        raise ValueError(f"the image processor makes {out_shape[0]}x{out_shape[1]} pixels, but the vision model takes "
                         f"{vision.image_size}x{vision.image_size}: processor and model folders do not belong together")
    import transformers  # tokenizers only; no torch on this path

    tokenizer = transformers.AutoTokenizer.from_pretrained(processor_folder or folder, local_files_only=True)
    params = from_state_dict(text, vision, convert.read_weights(folder, "model"))
    model = CLIP(text=text, vision=vision, image=image, tokenizer=tokenizer, max_length=text.max_position_embeddings)
    return model, params


# ----------------------------------------------------------------------------- one-time conversion (torch)


def convert_bin(folder: str) -> str:
    """`pytorch_model.bin` (or its sharded index) in `folder` -> `folder/model.safetensors`, the same tensors and dtypes.
    The one place here that imports torch. Returns the written path."""
    import safetensors.torch
    import torch

    index = os.path.join(folder, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        files = sorted(set(_read_json(index)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    else:
        raise FileNotFoundError(f"no pytorch_model.bin or pytorch_model.bin.index.json in {folder}")
    state_dict = {}
    for name in files:
        state_dict.update(torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True))
    # safetensors refuses tensors sharing memory (tied or viewed): one contiguous copy each.
    tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
    out = os.path.join(folder, "model.safetensors")
    safetensors.torch.save_file(tensors, out, metadata={"format": "pt"})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "convert-bin":
        raise SystemExit("usage: python -m flowrl_jax.models.clip convert-bin FOLDER")
    print(f"wrote {convert_bin(argv[1])}")


if __name__ == "__main__":
    main()
