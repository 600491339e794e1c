"""Per-function XLA options (passed to `jax.jit(..., compiler_options=...)`, so they never touch XLA_FLAGS).

    jax.jit(update, compiler_options=compiler.backward_options())

`backward_options()`: on the CPU, no YNNPACK library fusions. XLA:CPU (jaxlib 0.10) hands dots together with
their neighbouring layer norms, modulations and reductions to YNNPACK as one fusion; in the backward pass of
the MMDiT those fusions ran slower than XLA's own loop fusions (the Flow-GRPO update ~15% faster without them
on 2 cores, the forward-only rollout not; WORKSPACE_NOTES.md, issue 7). Other backends get no options, and a
jaxlib that does not know the option gets none either.

`use_persistent_cache(setting, workdir)`: JAX's persistent compilation cache, on by default for the CLI
(`config.compilation_cache`), so a second start (a resume, a preempted pod job, the same config again) loads the
compiled programs instead of compiling them (WORKSPACE_NOTES.md, issue 32: the measured effect).
"""
from __future__ import annotations

import functools
import os

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


DEFAULT_CACHE = os.path.join("~", ".cache", "flowrl_jax", "compilation_cache")


def cache_dir(setting: str, workdir: str | None) -> str | None:
    """`config.compilation_cache` -> the folder, or None (off). "auto": `<workdir>/compilation_cache` (a bucket works:
    every host of a pod and every restart then share it), `~/.cache/flowrl_jax/compilation_cache` without a workdir;
    "" or "none": off; anything else: that folder (local or gs://)."""
    if setting in ("", "none"):
        return None
    if setting == "auto":
        return os.path.join(workdir, "compilation_cache") if workdir else os.path.expanduser(DEFAULT_CACHE)
    return os.path.expanduser(setting)


def use_persistent_cache(setting: str, workdir: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `cache_dir(setting, workdir)`; call once per process, before the
    first compile. Programs that compile in under a second are not stored (JAX's default threshold). "auto" keeps a
    folder already set (JAX_COMPILATION_CACHE_DIR)."""
    if setting == "auto" and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = cache_dir(setting, workdir)
    if folder is not None:
        jax.config.update("jax_compilation_cache_dir", folder)
    return folder
