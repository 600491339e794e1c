"""Runs of identical layers as one `lax.scan` over their variables stacked on a leading axis.

    carry = scan_layers(module.variables, ["layers_0", "layers_1", ...], step, carry, remat=False)

`step(variables, carry) -> carry` applies one layer (an unbound module's `apply` with one layer's variables). XLA
then compiles the layer once instead of once per layer, so compile time stops growing with the depth
(WORKSPACE_NOTES.md, issue 32), and under `remat` each layer's recomputation waits for the backward pass to reach it
(in an unrolled chain XLA:CPU schedules all of them early and remat saves nothing; the memory plan). The parameter
layout is unchanged (one subtree per layer, the checkpoints' and the sharding rules' names); the stacked copy is
made on the fly, once per call, sharded as the layers are. Every collection whose tree holds all the layers is
stacked (params, LoRA adapters).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def stacked_variables(variables: dict, names: Sequence[str]) -> dict:
    """{collection: the layers `names`' subtrees stacked leaf by leaf on a new leading axis [len(names), ...]}."""
    return {col: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *(tree[n] for n in names))
            for col, tree in variables.items() if all(n in tree for n in names)}


def scan_layers(variables: dict, names: Sequence[str], step: Callable[[dict, Any], Any], carry: Any,
                remat: bool = False) -> Any:
    """`carry` through the layers `names` (equal structure) in order, as one `lax.scan` of `step`; `remat`:
    `jax.checkpoint` each layer."""
    def body(c, layer_variables):
        return step(layer_variables, c), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    carry, _ = jax.lax.scan(body, carry, stacked_variables(variables, names))
    return carry
