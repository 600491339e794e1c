"""diffusers `SD3Transformer2DModel` weights <-> `MMDiT` params, without importing torch.

    model, params = load_diffusers("path/to/sd3.5-medium")            # folder (or its transformer/)
    params = from_state_dict(model, torch_model.state_dict())         # any {name: array-like}
    state_dict = to_state_dict(model, params)                         # numpy, diffusers names

One table (`_FLAX_TO_DIFFUSERS`) names every parameter in both worlds; conversion walks our param
tree, so an unknown key in the source, a missing one or a shape mismatch is an error that lists
them. Layouts: torch Linear `weight [out, in]` is our `kernel [in, out]`; the patch-embedding conv
`weight [D, C, p, p]` is our dense `kernel [p*p*C, D]` over `patchify`'d tokens; RMSNorm `weight` is
our `scale`. The fixed position table `pos_embed.pos_embed` is not a parameter: we recompute it
and check the stored one against it.
"""
from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy

from flowrl_jax.models.flux import Flux
from flowrl_jax.models.mmdit import MMDiT, sincos_pos_embed_2d

HPARAMS = (
    "sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
    "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels",
    "pos_embed_max_size", "dual_attention_layers", "qk_norm",
)
_POS_TABLE_KEY = "pos_embed.pos_embed"

# Our path (with "/") -> diffusers key prefix, applied in order; then "/" -> ".".
_LAYERS_TO_DIFFUSERS = (
    (r"/to_out/", "/to_out.0/"),
    (r"/(ff|ff_context)/fc1/", r"/\1.net.0.proj/"),
    (r"/(ff|ff_context)/fc2/", r"/\1.net.2/"),
    (r"/(kernel|scale)$", "/weight"),
)
_FLAX_TO_DIFFUSERS = (
    (r"^pos_embed_proj/", "pos_embed.proj/"),
    (r"^time_linear_(\d)/", r"time_text_embed.timestep_embedder.linear_\1/"),
    (r"^text_linear_(\d)/", r"time_text_embed.text_embedder.linear_\1/"),
    (r"^transformer_blocks_(\d+)/", r"transformer_blocks.\1/"),
) + _LAYERS_TO_DIFFUSERS
_FLUX_TO_DIFFUSERS = (
    (r"^time_linear_(\d)/", r"time_text_embed.timestep_embedder.linear_\1/"),
    (r"^guidance_linear_(\d)/", r"time_text_embed.guidance_embedder.linear_\1/"),
    (r"^text_linear_(\d)/", r"time_text_embed.text_embedder.linear_\1/"),
    (r"^(single_transformer_blocks|transformer_blocks)_(\d+)/", r"\1.\2/"),
) + _LAYERS_TO_DIFFUSERS
FLUX_HPARAMS = (
    "patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
    "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds", "axes_dims_rope",
)


class ConversionError(ValueError):
    """The weights do not fit the model: lists every unknown, missing or mis-shaped key."""


def diffusers_key(flax_path: str, table=_FLAX_TO_DIFFUSERS) -> str:
    """'transformer_blocks_0/ff/fc1/kernel' -> 'transformer_blocks.0.ff.net.0.proj.weight'."""
    key = flax_path
    for pattern, repl in table:
        key = re.sub(pattern, repl, key)
    return key.replace("/", ".")


def flux_key(flax_path: str) -> str:
    """'single_transformer_blocks_3/attn/norm_q/scale' -> 'single_transformer_blocks.3.attn.norm_q.weight'."""
    return diffusers_key(flax_path, _FLUX_TO_DIFFUSERS)


def flux_from_config(config: Mapping[str, Any], cls: type = Flux, **overrides) -> Flux:
    """A `Flux` (or `cls`, e.g. `flux.FluxLatents`) from a diffusers `FluxTransformer2DModel` config.json dict (keys
    starting with '_' are metadata)."""
    return _from_config(cls, FLUX_HPARAMS, ("axes_dims_rope",), config, overrides)


def _from_config(cls, hparams: Sequence[str], tuples: Sequence[str], config: Mapping[str, Any], overrides: dict):
    """`cls(**the config's hparams, **overrides)`; ConversionError naming the keys `cls` does not know."""
    unknown = sorted(k for k in config if not k.startswith("_") and k not in hparams)
    if unknown:
        raise ConversionError(f"config.json has keys {cls.__name__} does not know: {unknown}; known: {list(hparams)}")
    kwargs = {k: tuple(v) if k in tuples and v is not None else v for k, v in config.items() if k in hparams}
    return cls(**kwargs, **overrides)


def flux_from_state_dict(model: Flux, state_dict: Mapping[str, Any]) -> dict:
    """A diffusers `FluxTransformer2DModel` state_dict -> our `params` tree (in `model.param_dtype`)."""
    return convert_tree(flat_abstract_params(model, *model.dummy_inputs()), state_dict, flux_key,
                        lambda path, value: value.T if path.endswith("/kernel") else value, model.param_dtype, what="Flux")


def mmdit_from_config(config: Mapping[str, Any], **overrides) -> MMDiT:
    """An `MMDiT` from a diffusers `config.json` dict (keys starting with '_' are metadata)."""
    return _from_config(MMDiT, HPARAMS, ("dual_attention_layers",), config, overrides)


def _abstract_params(model: MMDiT) -> dict:
    return flat_abstract_params(model, *model.dummy_inputs())


def _to_numpy(value) -> np.ndarray:
    """Array-like (numpy, jax, torch CPU tensor) -> host numpy, without importing torch: floating values keep
    their width (a bfloat16 file stays bfloat16 on the host until it is cast to the model's dtype), others float32."""
    if hasattr(value, "detach"):  # a torch tensor: leave bfloat16 through float(), which numpy lacks
        value = value.detach().cpu().float()
    value = np.asarray(value)
    return value if value.dtype in (np.float32, np.float16, ml_dtypes.bfloat16) else value.astype(np.float32)


def _expected_pos_table(model: MMDiT) -> np.ndarray | None:
    if not model.pos_embed_max_size:
        return None
    table = sincos_pos_embed_2d(model.inner_dim, model.pos_embed_max_size, model.sample_size // model.patch_size)
    return table.reshape(1, -1, model.inner_dim)


def convert_tree(abstract: Mapping[str, Any], state_dict: Mapping[str, Any], key_of: Callable[[str], str],
                 transform: Callable[[str, np.ndarray], np.ndarray] | None = None, dtype=jnp.float32,
                 ignored: Callable[[str], bool] = lambda key: False, what: str = "the model") -> dict:
    """A {name: array-like} state_dict -> a params tree, for any port (MMDiT, CLIP, T5, VAE).

    The tree's leaves are host numpy arrays in `dtype`, on no device: placing them is the caller's, shard by shard
    (`parallel.put_global`), so no device ever holds a whole tensor it does not own.
    abstract   {our "a/b/kernel" path: ShapeDtypeStruct} (`flat_abstract_params`)
    key_of     our path -> the reference's key;  transform (path, float32 value) -> our layout
    ignored    reference keys that are no parameter of ours (buffers such as position_ids)
    Every unknown, missing or mis-shaped key is collected into one `ConversionError` that names them.
    """
    flat, missing, mismatched = {}, [], []
    for path, spec in abstract.items():
        key = key_of(path)
        if key not in state_dict:
            missing.append(key)
            continue
        value = _to_numpy(state_dict[key])
        if transform is not None:
            value = transform(path, value)
        if value.shape != tuple(spec.shape):
            mismatched.append(f"{key}: got {value.shape}, model expects {tuple(spec.shape)}")
            continue
        flat[path] = np.asarray(value, dtype=jnp.dtype(dtype))  # host memory; ml_dtypes gives numpy bfloat16
    claimed = {key_of(path) for path in abstract}
    unknown = sorted(k for k in state_dict if k not in claimed and not ignored(k))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown keys (not in this config of {what}): {unknown}")
    if missing:
        problems.append(f"{len(missing)} missing keys: {missing}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {mismatched}")
    if problems:
        raise ConversionError(f"cannot load weights into {what}: " + "; ".join(problems))
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def flat_abstract_params(module, *inputs) -> dict:
    """{"a/b/kernel": ShapeDtypeStruct} of `module.init(rng, *inputs)["params"]`, computed abstractly."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs))
    return flax.traverse_util.flatten_dict(shapes["params"], sep="/")


def from_state_dict(model: MMDiT, state_dict: Mapping[str, Any]) -> dict:
    """A diffusers state_dict ({name: array-like}) -> our `params` tree (in `model.param_dtype`)."""
    p, c = model.patch_size, model.in_channels

    def transform(path, value):
        if path == "pos_embed_proj/kernel":  # conv [D, C, p, p] -> [p*p*C, D] (patchify order p, q, C)
            return value.transpose(2, 3, 1, 0).reshape(p * p * c, -1) if value.ndim == 4 else value
        return value.T if path.endswith("/kernel") else value

    params = convert_tree(_abstract_params(model), state_dict, diffusers_key, transform, model.param_dtype,
                          ignored=lambda key: key == _POS_TABLE_KEY, what="MMDiT")
    if _POS_TABLE_KEY in state_dict:
        table, ours = _to_numpy(state_dict[_POS_TABLE_KEY]).astype(np.float32), _expected_pos_table(model)
        if ours is None or table.shape != ours.shape or not np.allclose(table, ours, atol=1e-4):
            raise ConversionError(
                f"cannot load weights into MMDiT: {_POS_TABLE_KEY} does not match the sin-cos table of "
                f"sample_size={model.sample_size}, patch_size={p}, pos_embed_max_size={model.pos_embed_max_size}: check the config"
            )
    return params


def diffusers_tensors(model: MMDiT, params: Mapping[str, Any]) -> Iterator[tuple[str, int, Callable[[], np.ndarray]]]:
    """(diffusers key, its number of elements, a function giving its float32 value) for every tensor of `params`, the
    inverse of `from_state_dict`:
    each value is made when called, one at a time (a writer holds one shard, never the whole converted model)."""
    p, c = model.patch_size, model.in_channels

    def value_of(path, value):
        value = np.array(value, dtype=np.float32)  # a writable host copy
        if path == "pos_embed_proj/kernel":
            value = value.reshape(p, p, c, -1).transpose(3, 2, 0, 1)
        elif path.endswith("/kernel"):
            value = value.T
        return np.ascontiguousarray(value)

    for path, value in flax.traverse_util.flatten_dict(dict(params), sep="/").items():
        yield diffusers_key(path), int(np.size(value)), functools.partial(value_of, path, value)
    table = _expected_pos_table(model)
    if table is not None:
        yield _POS_TABLE_KEY, table.size, table.copy


def to_state_dict(model: MMDiT, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Our `params` -> a diffusers state_dict of float32 numpy arrays (inverse of `from_state_dict`)."""
    return {key: make() for key, _, make in diffusers_tensors(model, params)}


def diffusers_config(model: MMDiT) -> dict:
    """The `config.json` of `SD3Transformer2DModel` for this MMDiT (its HPARAMS)."""
    config = {"_class_name": "SD3Transformer2DModel", **{k: getattr(model, k) for k in HPARAMS}}
    if config["dual_attention_layers"] is not None:
        config["dual_attention_layers"] = list(config["dual_attention_layers"])
    return config


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """`tensors` as one safetensors file (F32, F16 or BF16: the format's spec, which safetensors' numpy writer lacks for
    BF16): an 8-byte little-endian header length, the JSON header padded to 8 bytes, the tensors' bytes in key order."""
    header, offset = {}, 0
    for name in sorted(tensors):
        value = tensors[name]
        if value.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {value.dtype} is not one of {sorted(map(str, _SAFETENSORS_DTYPES))}")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape), "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def save_diffusers(folder: str, model: MMDiT, params: Mapping[str, Any], dtype=np.float32, max_shard_gb: float = 5.0) -> list[str]:
    """An `SD3Transformer2DModel.from_pretrained` folder: config.json and `diffusion_pytorch_model.safetensors` in `dtype`,
    or its shards (`-0000i-of-0000n.safetensors` + `.index.json`, as diffusers names them) of at most `max_shard_gb` each.
    Written shard by shard from host memory: a shard's tensors are converted when it is written. -> the files written."""
    os.makedirs(folder, exist_ok=True)
    dtype = np.dtype(dtype)
    entries = list(diffusers_tensors(model, params))
    sizes = {key: size * dtype.itemsize for key, size, _ in entries}
    shards, current, used = [], [], 0
    for key, _, make in entries:
        if current and used + sizes[key] > max_shard_gb * 2**30:
            shards.append(current)
            current, used = [], 0
        current.append((key, make))
        used += sizes[key]
    shards.append(current)
    names = ([f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["diffusion_pytorch_model.safetensors"])
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(folder, name), {key: make().astype(dtype) for key, make in shard}, {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key, _ in shard}}
        with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(diffusers_config(model), f, indent=2)
    return [os.path.join(folder, n) for n in names]


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """safetensors' numpy loader, extended to BF16 (which numpy lacks) through ml_dtypes: BF16 tensors come back
    as `ml_dtypes.bfloat16` numpy arrays (half the host memory of float32; exact either way)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    if all(info["dtype"] != "BF16" for info in header.values()):
        return safetensors.numpy.load_file(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        if info["dtype"] == "BF16":
            out[name] = np.array(data[start:end].view(ml_dtypes.bfloat16).reshape(info["shape"]))
        else:
            dtype = safetensors.numpy._getdtype(info["dtype"])
            out[name] = np.array(data[start:end].view(dtype).reshape(info["shape"]))
    return out


def read_weights(folder: str, stem: str = "diffusion_pytorch_model") -> dict[str, np.ndarray]:
    """Every tensor of `folder/<stem>.safetensors` or of the shards its `.index.json` lists, as numpy (no torch).
    diffusers saves `diffusion_pytorch_model.*`, transformers `model.*`."""
    index, single = os.path.join(folder, f"{stem}.safetensors.index.json"), os.path.join(folder, f"{stem}.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            files = [os.path.join(folder, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    elif os.path.exists(single):
        files = [single]
    else:
        found = sorted(os.listdir(folder)) if os.path.isdir(folder) else "no such folder"
        raise FileNotFoundError(f"no weights in {folder}: expected {stem}.safetensors or its .index.json (found {found}); "
                                "save the model with save_pretrained(..., safe_serialization=True)")
    state_dict = {}
    for file in files:
        if not os.path.exists(file):
            raise FileNotFoundError(f"weight shard {file} listed in the index is missing")
        state_dict.update(read_safetensors(file))
    return state_dict


def load_folder(path: str, build: Callable, to_params: Callable, what: str, subfolder: str = "",
                stem: str = "diffusion_pytorch_model", **overrides) -> tuple[Any, dict]:
    """(model, params) from a folder holding `config.json` + `<stem>*.safetensors` (sharded or not), or from a
    pipeline folder holding it as `subfolder/`: `build(config dict, **overrides)`, then `to_params(model, state_dict)`.
    No torch import. A missing config or weight file is a FileNotFoundError naming it and `what` was expected."""
    nested = os.path.join(path, subfolder) if subfolder else ""
    folder = nested if nested and os.path.isfile(os.path.join(nested, "config.json")) else path
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: point to {what}")
    with open(config_path) as f:
        model = build(json.load(f), **overrides)
    return model, to_params(model, read_weights(folder, stem))


def load_diffusers(path: str, **model_overrides) -> tuple[MMDiT, dict]:
    """Load a diffusers SD3 transformer folder (`config.json` + `*.safetensors`, sharded or not; a
    pipeline folder's `transformer/` is found too) -> (model, params). No torch import."""
    return load_folder(path, mmdit_from_config, from_state_dict, "a diffusers SD3Transformer2DModel folder", "transformer",
                       **model_overrides)


def load_flux(path: str, **model_overrides) -> tuple[Flux, dict]:
    """Load a diffusers FLUX.1 transformer folder (dev or schnell; a pipeline folder's `transformer/` is found too)
    -> (model, params); `cls=flux.FluxLatents` for the latent-space model. No torch import."""
    return load_folder(path, flux_from_config, flux_from_state_dict, "a diffusers FluxTransformer2DModel folder", "transformer",
                       **model_overrides)
