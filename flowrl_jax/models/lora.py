"""LoRA adapters as a separate trainable pytree (the `lora` variable collection of `MMDiT`).

    adapters = init_adapters(params, rng, rank=32)                      # zero effect at init
    v = model.apply({"params": base, "lora": adapters}, x, t, txt, pooled)
    merged = merge(base, adapters, alpha=model.lora_alpha)              # same function, one kernel

Each targeted kernel `W [in, out]` gets `a [in, r]` (`init="kaiming"`: uniform in +-1/sqrt(in), PEFT's
default; `"gaussian"`: normal with std 1/r, PEFT's `init_lora_weights="gaussian"`, Flow-GRPO's) and `b [r, out]` (zeros), so `W_eff = W + (alpha / r) a @ b`. The frozen base params are the
Flow-GRPO KL reference for free. The default targets are Flow-GRPO's (r=32, alpha=64): the joint
attention projections `attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}`.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp

FLOW_GRPO_TARGETS = r"/attn/(to_q|to_k|to_v|to_out|add_q_proj|add_k_proj|add_v_proj|to_add_out)/kernel$"
# flow_grpo's FLUX LoRA (scripts/train_flux.py: r=64, alpha=128, gaussian): the eight attention projections and both
# MLPs of the double blocks; PEFT matches by suffix, so the single blocks' attn.to_q/k/v are adapted too
FLOW_GRPO_FLUX_TARGETS = (r"/(attn/(to_q|to_k|to_v|to_out|add_q_proj|add_k_proj|add_v_proj|to_add_out)|(ff|ff_context)/(fc1|fc2))"
                          r"/kernel$")


INITS = ("kaiming", "gaussian")


def init_adapters(params: Mapping[str, Any], rng: jax.Array, rank: int = 32, targets: str = FLOW_GRPO_TARGETS, dtype=jnp.float32,
                  init: str = "kaiming") -> dict:
    """The `lora` collection for every kernel whose path ('transformer_blocks_0/attn/to_q/kernel')
    matches the regex `targets`: {module path: {"a": [in, r], "b": [r, out]}}; `init` (module doc)."""
    if init not in INITS:
        raise ValueError(f"LoRA init {init!r} (train.lora_init): choose one of {', '.join(INITS)}")
    flat = flax.traverse_util.flatten_dict(dict(params), sep="/")
    matched = sorted(path for path in flat if re.search(targets, path))
    if not matched:
        examples = sorted(p for p in flat if p.endswith("/kernel"))[:5]
        raise ValueError(f"LoRA targets regex {targets!r} matches no kernel; kernel paths look like {examples}")
    adapters = {}
    for path, key in zip(matched, jax.random.split(rng, len(matched))):
        fan_in, fan_out = flat[path].shape
        module = path[: -len("/kernel")]
        if init == "gaussian":
            adapters[module + "/a"] = jax.random.normal(key, (fan_in, rank), dtype) / rank
        else:
            bound = 1.0 / fan_in**0.5
            adapters[module + "/a"] = jax.random.uniform(key, (fan_in, rank), dtype, -bound, bound)
        adapters[module + "/b"] = jnp.zeros((rank, fan_out), dtype)
    return flax.traverse_util.unflatten_dict(adapters, sep="/")


def merge(params: Mapping[str, Any], adapters: Mapping[str, Any], alpha: float) -> dict:
    """Base params with each adapted kernel replaced by `W + (alpha / r) a @ b`."""
    flat = flax.traverse_util.flatten_dict(dict(params), sep="/")
    leaves = flax.traverse_util.flatten_dict(dict(adapters), sep="/")
    for module in sorted({path.rsplit("/", 1)[0] for path in leaves}):
        a, b = leaves[module + "/a"], leaves[module + "/b"]
        kernel = flat[module + "/kernel"]
        flat[module + "/kernel"] = (kernel + (alpha / a.shape[-1]) * (a @ b)).astype(kernel.dtype)
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def num_params(tree: Any) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))
