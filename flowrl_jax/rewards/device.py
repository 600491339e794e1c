"""Rewards computed in JAX on the device, differentiable in the images: the CLIP family (flow_grpo's formulas).

    reward = pickscore(models)                     # models: config.world.reward_models (folders by name)
    r = reward.apply(reward.params, images, ids)   # images [B, H, W, 3] in [-1, 1], ids [B, L] -> [B]; jit / grad it
    ids = reward.tokenize(prompt_rows)             # host, numpy

- `pickscore`: `exp(logit_scale) * cos(image, text) / 26` (flow_grpo `pickscore_scorer.py`): PickScore_v1, whose
  processor and tokenizer flow_grpo takes from laion's CLIP-ViT-H-14 (`reward_models.pickscore_processor`, optional).
- `clipscore`: `exp(logit_scale) * cos(image, text) / 30`, `logits_per_image.diagonal() / 30` (flow_grpo
  `clip_scorer.py`, openai/clip-vit-large-patch14; its preprocessing is in-graph too, torchvision on float pixels).
- `aesthetic`: the LAION improved-aesthetic MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1, linear layers, dropout off)
  on the L2-normalised CLIP-L/14 image embedding (flow_grpo `aesthetic_scorer.py`). Its weights come from
  `reward_models.aesthetic_mlp`: a `.safetensors` or `.npz` file with `layers.{0,2,4,6,7}.{weight,bias}` (the torch
  state_dict's keys); the published `.pth` converts once with `python -m flowrl_jax.rewards.device convert-pth
  FILE.pth FILE.safetensors` (needs torch, that command only).
The images go through the CLIP folder's own preprocessing in the graph (`clip.CLIP.preprocess`: shortest-edge resize,
centre crop, mean/std), so the reward is differentiable in the pixels and, through the VAE decoder, in the latents.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax import parallel

FOLDERS = {  # config.world.reward_models: where each device reward's weights are ("" = not given)
    "pickscore": "",            # a transformers CLIPModel folder (PickScore_v1)
    "pickscore_processor": "",  # optional: the folder with its processor + tokenizer (laion CLIP-ViT-H-14); "" = the model's
    "clipscore": "",            # a CLIPModel folder (openai/clip-vit-large-patch14)
    "aesthetic_clip": "",       # the CLIP-L/14 CLIPModel folder the aesthetic MLP reads
    "aesthetic_mlp": "",        # the MLP's weights (.safetensors or .npz)
}
FOLDER_OF = {"pickscore": "pickscore", "clipscore": "clipscore", "aesthetic": "aesthetic_clip"}  # reward -> its main folder key
AESTHETIC_LAYERS = ((768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))  # layers.0, 2, 4, 6, 7 (dropouts between)
AESTHETIC_KEYS = ("layers.0", "layers.2", "layers.4", "layers.6", "layers.7")


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceReward:
    """`apply(params, images [B, H, W, 3] in [-1, 1], ids [B, L]) -> [B]` (pure, jittable, differentiable in images),
    its params (host numpy; placed by the caller) and `tokenize(prompt rows) -> ids` (host)."""
    name: str
    apply: Callable
    params: Any
    tokenize: Callable


def _folder(models, key: str, reward: str) -> str:
    path = models.get(key, "") if models is not None else ""
    if not path:
        raise ValueError(f"reward {reward!r} needs --config.world.reward_models.{key}=/path/to/folder (its weights); "
                         "no weights are downloaded")
    return path


def check(name: str, models) -> None:
    """One-line errors for a device reward whose folders are missing or of the wrong layout (cheap: no weights read)."""
    from flowrl_jax.models import clip

    if name in ("pickscore", "clipscore"):
        clip.check_folder(_folder(models, name, name), f"world.reward_models.{name}")
        if name == "pickscore" and models.get("pickscore_processor", ""):
            processor = models["pickscore_processor"]
            if not os.path.isdir(processor):
                raise FileNotFoundError(f"--config.world.reward_models.pickscore_processor: folder {processor} not found "
                                        "(a CLIP folder with preprocessor_config.json and the tokenizer files)")
    elif name == "aesthetic":
        clip.check_folder(_folder(models, "aesthetic_clip", name), "world.reward_models.aesthetic_clip")
        path = _folder(models, "aesthetic_mlp", name)
        if not os.path.isfile(path) or not path.endswith((".safetensors", ".npz")):
            raise FileNotFoundError(f"--config.world.reward_models.aesthetic_mlp={path}: expected an existing .safetensors or "
                                    ".npz file with layers.{0,2,4,6,7}.{weight,bias} (convert a .pth with "
                                    "`python -m flowrl_jax.rewards.device convert-pth FILE.pth FILE.safetensors`)")


def _normalized(x: jax.Array) -> jax.Array:
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def similarity(model, scale: float) -> Callable:
    """`apply(params, images, ids) = exp(logit_scale) * cos(image, text) / scale` of a `clip.CLIP` (pickscore: 26,
    clipscore: 30), the images through the model's own preprocessing."""
    def apply(p, images, ids):
        image = _normalized(model.image_embeds(p, model.preprocess(images)))
        text = _normalized(model.text_embeds(p, ids))
        return jnp.exp(p["logit_scale"]) * jnp.sum(image * text, axis=-1) / scale

    return apply


def _similarity(name: str, models, scale: float, processor_key: str | None = None) -> DeviceReward:
    """`similarity` of a CLIPModel folder."""
    from flowrl_jax.models import clip

    processor = models.get(processor_key, "") if processor_key else ""
    model, params = clip.load_clip(_folder(models, name, name), processor_folder=processor or None)
    return DeviceReward(name, similarity(model, scale), params, lambda rows: model.tokenize([r["prompt"] for r in rows]))


def read_aesthetic_mlp(path: str, width: int = 768) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(kernel [in, out], bias [out])] of the five linear layers `layers.{0,2,4,6,7}`: a chain from the CLIP
    embedding's `width` to one output (the published model: `AESTHETIC_LAYERS` on CLIP-L/14's 768)."""
    if path.endswith(".npz"):
        with np.load(path) as f:
            tensors = {k: np.asarray(f[k], np.float32) for k in f.files}
    else:
        from flowrl_jax.models import convert

        tensors = {k: np.asarray(v, np.float32) for k, v in convert.read_safetensors(path).items()}
    layers, n_in = [], width
    for i, key in enumerate(AESTHETIC_KEYS):
        w, b = tensors.get(f"{key}.weight"), tensors.get(f"{key}.bias")
        last = i == len(AESTHETIC_KEYS) - 1
        if w is None or b is None or w.ndim != 2 or w.shape[1] != n_in or b.shape != (w.shape[0],) or (last and w.shape[0] != 1):
            raise ValueError(f"{path}: {key}.weight [out, {n_in}] and {key}.bias [out] expected, the last layer's out 1 (the "
                             f"LAION improved-aesthetic MLP's state_dict on a {width}-wide CLIP embedding), found "
                             f"{ {k: tuple(v.shape) for k, v in sorted(tensors.items())[:12]} }")
        layers.append((w.T.copy(), b))
        n_in = w.shape[0]
    return layers


def aesthetic_mlp(layers, embed: jax.Array) -> jax.Array:
    """The MLP on [B, 768] -> [B]: five linear layers, no activation between them (the published model's `MLP`)."""
    x = embed
    for kernel, bias in layers:
        x = x @ kernel + bias
    return x[:, 0]


def _aesthetic(models) -> DeviceReward:
    from flowrl_jax.models import clip

    model, params = clip.load_clip(_folder(models, "aesthetic_clip", "aesthetic"))
    width = model.vision.projection_dim
    params = {**params, "mlp": read_aesthetic_mlp(_folder(models, "aesthetic_mlp", "aesthetic"), width)}

    def apply(p, images, ids):
        del ids  # the aesthetic score reads the image alone
        return aesthetic_mlp(p["mlp"], _normalized(model.image_embeds(p, model.preprocess(images))))

    return DeviceReward("aesthetic", apply, params, lambda rows: np.zeros((len(rows), 1), np.int32))


FACTORIES: dict[str, Callable[[Any], DeviceReward]] = {
    "pickscore": lambda models: _similarity("pickscore", models, 26.0, "pickscore_processor"),
    "clipscore": lambda models: _similarity("clipscore", models, 30.0),
    "aesthetic": _aesthetic,
}


class OnDevice:
    """A device reward run on images where they lie: jitted, its params placed once per mesh they arrive on (the CLIP
    towers' kernels FSDP-sharded, `clip.PARTITION_RULES`, the rest replicated; host images: the default device)."""

    def __init__(self, reward: DeviceReward):
        self.reward, self.apply, self.placed = reward, jax.jit(reward.apply), {}

    def __call__(self, images, prompts) -> np.ndarray:
        ids = np.asarray(self.reward.tokenize(prompts))
        sharding = getattr(images, "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None
        if mesh not in self.placed:
            from flowrl_jax.models import clip
            params = self.reward.params
            self.placed[mesh] = (parallel.put_global(params, parallel.tree_shardings(params, mesh, clip.PARTITION_RULES))
                                 if mesh is not None else jax.tree_util.tree_map(jnp.asarray, params))
        if mesh is not None and images.shape[0] % parallel.batch_shards(mesh) == 0:
            return parallel.local_rows(self.apply(self.placed[mesh], images, parallel.shard_batch(ids, mesh)))
        return np.asarray(self.apply(self.placed[mesh], jnp.asarray(images), ids))


_LOADED: dict[tuple, tuple[DeviceReward, OnDevice]] = {}  # (name, its folders) -> the reward, loaded once


def loaded(name: str, models: Any) -> tuple[DeviceReward, OnDevice]:
    """A device reward and its runner, loaded once per process whoever asks (the train loop's rewards, the world's
    eval, the latent world's reward model): the weights are read and placed once, not once per caller."""
    key = (name, tuple(sorted((k, str(v)) for k, v in dict(models).items())))
    if key not in _LOADED:
        reward = FACTORIES[name](models)
        _LOADED[key] = (reward, OnDevice(reward))
    return _LOADED[key]


def load_all(weighted, models: Any) -> dict[str, DeviceReward]:
    """The device rewards of `weighted` ((name, weight) pairs), loaded (host params)."""
    return {str(n): loaded(str(n), models)[0] for n, _ in weighted if str(n) in FACTORIES}


def convert_pth(source: str, target: str) -> None:
    """A torch `.pth` state_dict (the published aesthetic MLP) -> `.safetensors`; the one place torch is imported."""
    import safetensors.numpy
    import torch

    state = torch.load(source, map_location="cpu", weights_only=True)
    safetensors.numpy.save_file({k: v.float().numpy() for k, v in state.items()}, target)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "convert-pth":
        sys.exit("usage: python -m flowrl_jax.rewards.device convert-pth FILE.pth FILE.safetensors")
    convert_pth(sys.argv[2], sys.argv[3])
    print(f"wrote {sys.argv[3]}")
