"""LoRA adapters <-> the files other tools read and write: a PEFT adapter folder and a diffusers LoRA file, no torch.

    write_peft_adapter(folder, adapters, alpha, dit_params)       # adapter_config.json + adapter_model.safetensors
    write_diffusers_lora(folder, adapters, alpha, dit_params)     # pytorch_lora_weights.safetensors
    adapters, alpha = read_lora(path, dit_params)                 # either layout, e.g. a flow_grpo checkpoint's adapter

Our adapters (`models/lora.py`) are {module path: {"a": [in, r], "b": [r, out]}} with `W_eff = W + (alpha / r) a @ b`;
PEFT's `lora_A.weight` is `a.T` [r, in] and `lora_B.weight` is `b.T` [out, r], with the same `lora_alpha / r` scale.
Module names are diffusers' (`transformer_blocks.0.attn.to_out.0`, `convert.diffusers_key`).

- The PEFT layout is what flow_grpo writes (`PeftModel.save_pretrained`: keys `base_model.model.<module>.lora_{A,B}.weight`,
  adapter_config.json with r, lora_alpha and target_modules) and `PeftModel.from_pretrained` reads.
- The diffusers layout is what `StableDiffusion3Pipeline.save_lora_weights` writes and `load_lora_weights` reads (keys
  `transformer.<module>.lora_{A,B}.weight`). Loaders that ignore its metadata (older diffusers, other UIs) take
  `lora_alpha = r`, so our file folds `alpha / r` into `lora_B` and records `lora_alpha = r`: every loader gets the same
  weights.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import flax
import numpy as np
import safetensors.numpy

from flowrl_jax.models import convert

PEFT_PREFIX = "base_model.model."     # PeftModel.save_pretrained
DIFFUSERS_PREFIX = "transformer."     # StableDiffusion3Pipeline.save_lora_weights
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY


class LoraFileError(ValueError):
    """A LoRA file this model cannot take: names the file and what does not fit."""


def module_names(dit_params: Mapping[str, Any]) -> dict[str, str]:
    """{diffusers module name: our module path} of every kernel of the DiT ('transformer_blocks.0.attn.to_q':
    'transformer_blocks_0/attn/to_q')."""
    flat = flax.traverse_util.flatten_dict(dict(dit_params), sep="/")
    return {convert.diffusers_key(p)[: -len(".weight")]: p[: -len("/kernel")] for p in flat if p.endswith("/kernel")}


def _adapted(adapters: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{our module path: (a [in, r], b [r, out]) as float32 host arrays}."""
    flat = flax.traverse_util.flatten_dict(dict(adapters), sep="/")
    modules = sorted({p.rsplit("/", 1)[0] for p in flat})
    return {m: (np.asarray(flat[m + "/a"], np.float32), np.asarray(flat[m + "/b"], np.float32)) for m in modules}


def rank_of(adapters: Mapping[str, Any]) -> int:
    ranks = {a.shape[1] for a, _ in _adapted(adapters).values()}
    if len(ranks) != 1:
        raise LoraFileError(f"adapters of several ranks {sorted(ranks)}: one rank per LoRA")
    return ranks.pop()


def target_modules(adapters: Mapping[str, Any], dit_params: Mapping[str, Any]) -> list[str]:
    """PEFT's `target_modules` for the adapted modules: their last two name parts ('attn.to_q', 'attn.to_out.0', as flow_grpo
    lists them) when those select exactly the adapted modules of this DiT (PEFT matches a name by suffix), else every
    adapted module's full name."""
    names = {ours: theirs for theirs, ours in module_names(dit_params).items()}
    adapted = sorted(names[m] for m in _adapted(adapters))
    short = sorted({".".join(n.split(".")[-3 if n.split(".")[-1].isdigit() else -2:]) for n in adapted})
    selected = sorted(n for n in names.values() if any(n == s or n.endswith("." + s) for s in short))
    return short if selected == adapted else adapted


def peft_state_dict(adapters: Mapping[str, Any], dit_params: Mapping[str, Any], prefix: str, b_scale: float = 1.0) -> dict:
    """{prefix + '<module>.lora_A.weight': a.T [r, in], ... '.lora_B.weight': b_scale * b.T [out, r]} float32."""
    names = {ours: theirs for theirs, ours in module_names(dit_params).items()}
    out = {}
    for module, (a, b) in _adapted(adapters).items():
        if module not in names:
            raise LoraFileError(f"adapter on {module!r}, which is no Dense layer of this DiT")
        out[f"{prefix}{names[module]}.lora_A.weight"] = np.ascontiguousarray(a.T)
        out[f"{prefix}{names[module]}.lora_B.weight"] = np.ascontiguousarray((b_scale * b).T)
    return out


def write_peft_adapter(folder: str, adapters, alpha: float, dit_params, base_model: str = "") -> str:
    """flow_grpo's layout (`PeftModel.save_pretrained`): `folder/adapter_config.json` + `adapter_model.safetensors`."""
    os.makedirs(folder, exist_ok=True)
    r = rank_of(adapters)
    config = {"peft_type": "LORA", "task_type": None, "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": target_modules(adapters, dit_params), "init_lora_weights": "gaussian", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
              "base_model_name_or_path": base_model or None, "inference_mode": True}
    with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    safetensors.numpy.save_file(peft_state_dict(adapters, dit_params, PEFT_PREFIX), os.path.join(folder, PEFT_WEIGHTS),
                                metadata={"format": "pt"})
    return folder


def write_diffusers_lora(folder: str, adapters, alpha: float, dit_params) -> str:
    """`folder/pytorch_lora_weights.safetensors` as `save_lora_weights` writes it, `alpha / r` folded into lora_B (module doc)."""
    os.makedirs(folder, exist_ok=True)
    r = rank_of(adapters)
    meta = {f"{DIFFUSERS_PREFIX}{k}": v for k, v in
            {"r": r, "lora_alpha": r, "target_modules": target_modules(adapters, dit_params), "use_dora": False}.items()}
    path = os.path.join(folder, DIFFUSERS_WEIGHTS)
    safetensors.numpy.save_file(peft_state_dict(adapters, dit_params, DIFFUSERS_PREFIX, alpha / r), path,
                                metadata={"format": "pt", METADATA_KEY: json.dumps(meta, sort_keys=True)})
    return path


def _weights_file(path: str) -> tuple[str, dict | None]:
    """(the safetensors file, the PEFT adapter_config.json's dict or None) of a LoRA folder or file."""
    if os.path.isfile(path):
        return path, None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA {path} not found: give a PEFT adapter folder ({PEFT_CONFIG} + {PEFT_WEIGHTS}), a "
                                f"diffusers LoRA folder ({DIFFUSERS_WEIGHTS}) or a .safetensors file")
    if os.path.isfile(os.path.join(path, PEFT_CONFIG)):
        with open(os.path.join(path, PEFT_CONFIG)) as f:
            return os.path.join(path, PEFT_WEIGHTS), json.load(f)
    candidates = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if DIFFUSERS_WEIGHTS in candidates or len(candidates) == 1:
        return os.path.join(path, DIFFUSERS_WEIGHTS if DIFFUSERS_WEIGHTS in candidates else candidates[0]), None
    raise FileNotFoundError(f"{path} holds no LoRA: expected {PEFT_CONFIG} + {PEFT_WEIGHTS} or {DIFFUSERS_WEIGHTS} "
                            f"(found {candidates or 'no .safetensors file'})")


def _file_metadata(path: str) -> dict:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    meta = header.get("__metadata__") or {}
    if METADATA_KEY not in meta:
        return {}
    return {k[len(DIFFUSERS_PREFIX):] if k.startswith(DIFFUSERS_PREFIX) else k: v for k, v in json.loads(meta[METADATA_KEY]).items()}


def read_lora(path: str, dit_params: Mapping[str, Any]) -> tuple[dict, float]:
    """(adapters {module path: {"a" [in, r], "b" [r, out]}} float32, alpha) of a PEFT adapter folder (flow_grpo's), a
    diffusers LoRA folder or a .safetensors file in either key layout. alpha: adapter_config.json's, else the file's
    diffusers metadata, else r (diffusers' rule for a file without either). A key of another layout (kohya's
    `lora_unet_*`, `.alpha` tensors), a module this DiT lacks or a shape that does not fit is a LoraFileError naming it."""
    file, config = _weights_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} not found (the LoRA's weights)")
    tensors = convert.read_safetensors(file)
    meta = config if config is not None else _file_metadata(file)
    for key in ("rank_pattern", "alpha_pattern"):
        if meta.get(key):
            raise LoraFileError(f"{path}: per-module {key} {meta[key]} is not supported (one rank and alpha per LoRA)")
    if meta.get("use_dora") or meta.get("use_rslora"):
        raise LoraFileError(f"{path}: DoRA / rsLoRA adapters are not plain LoRA (use_dora / use_rslora is set)")
    names, flat = module_names(dit_params), flax.traverse_util.flatten_dict(dict(dit_params), sep="/")
    pattern = re.compile(r"^(?:base_model\.model\.|transformer\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = pattern.match(key)
        if match is None:
            raise LoraFileError(f"{path}: key {key!r} is not a PEFT / diffusers LoRA key (<module>.lora_A.weight / lora_B.weight); "
                                "convert other layouts (kohya's lora_unet_*) with diffusers' load_lora_weights + save_lora_weights first")
        module, which = match.groups()
        if module not in names:
            raise LoraFileError(f"{path}: {key!r} adapts {module!r}, which this DiT does not have (e.g. "
                                f"{sorted(names)[:3]}): the LoRA was trained on another model")
        pairs.setdefault(names[module], {})[which] = np.asarray(value, np.float32)
    if not pairs:
        raise LoraFileError(f"{path}: no LoRA weights in {file}")
    adapters, ranks = {}, set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraFileError(f"{path}: {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"].T, ab["B"].T
        kernel = flat[module + "/kernel"].shape
        if a.shape[0] != kernel[0] or b.shape[1] != kernel[1] or a.shape[1] != b.shape[0]:
            raise LoraFileError(f"{path}: {module}: lora_A {ab['A'].shape} / lora_B {ab['B'].shape} do not fit the kernel "
                                f"[in, out] = {kernel}")
        adapters[module + "/a"], adapters[module + "/b"] = a, b
        ranks.add(a.shape[1])
    if len(ranks) != 1:
        raise LoraFileError(f"{path}: adapters of several ranks {sorted(ranks)}")
    r = ranks.pop()
    if meta.get("r") not in (None, r):
        raise LoraFileError(f"{path}: its config says r={meta['r']}, its weights have rank {r}")
    alpha = float(meta.get("lora_alpha") or r)
    return flax.traverse_util.unflatten_dict(adapters, sep="/"), alpha


def rescaled(adapters, alpha: float, model_alpha: float) -> dict:
    """The same LoRA for a model whose scale is `model_alpha / r`: b times `alpha / model_alpha`."""
    return flax.traverse_util.unflatten_dict(
        {p: (v * (alpha / model_alpha) if p.endswith("/b") else v)
         for p, v in flax.traverse_util.flatten_dict(dict(adapters), sep="/").items()}, sep="/")
