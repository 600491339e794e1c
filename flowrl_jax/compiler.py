"""Per-function XLA options (passed to `jax.jit(..., compiler_options=...)`, so they never touch XLA_FLAGS).

    jax.jit(update, compiler_options=compiler.backward_options())

`backward_options()`: on the CPU, no YNNPACK library fusions. XLA:CPU (jaxlib 0.10) hands dots together with
their neighbouring layer norms, modulations and reductions to YNNPACK as one fusion; in the backward pass of
the MMDiT those fusions ran slower than XLA's own loop fusions (the Flow-GRPO update ~15% faster without them
on 2 cores, the forward-only rollout not; WORKSPACE_NOTES.md, issue 7). Other backends get no options, and a
jaxlib that does not know the option gets none either.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_CPU_BACKWARD = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def backward_options() -> dict | None:
    if jax.default_backend() != "cpu":
        return None
    try:  # an option this jaxlib does not know fails at compile time: probe once
        jax.jit(jnp.negative, compiler_options=_CPU_BACKWARD).lower(jnp.zeros(1)).compile()
    except Exception:  # noqa: BLE001 - XlaRuntimeError / ValueError, depending on the version
        return None
    return dict(_CPU_BACKWARD)
