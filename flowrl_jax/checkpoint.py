"""Orbax checkpoints: save, keep-N, resume from the latest, restore a state pytree by template.

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=3)
    ckpt.save(step, state, meta={"config": ...})       # async; ckpt.close() waits
    state, meta = ckpt.restore_latest(template)        # (None, None) when there is none yet

A checkpoint is `args.Composite(state=StandardSave(pytree), meta=JsonSave(dict))`. Restoring into
`template` (arrays or `jax.ShapeDtypeStruct`s, with shardings) gives the same structure back,
sharded like the template.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) if hasattr(x, "shape") else x, tree)


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict | None = None, force: bool = False) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta or {}))
        self.manager.save(step, args=args, force=force)

    def restore(self, step: int, template: Any) -> tuple[Any, dict]:
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {sorted(self.manager.all_steps())}")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore())
        out = self.manager.restore(step, args=args)
        return out["state"], dict(out["meta"])

    def restore_latest(self, template: Any) -> tuple[Any, dict] | tuple[None, None]:
        step = self.latest_step()
        return (None, None) if step is None else self.restore(step, template)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_params(directory: str, params: Any) -> None:
    """One-off save of a params pytree (shipped assets): a plain orbax StandardCheckpointer folder."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(directory), params, force=True)


def load_params(directory: str, template: Any | None = None) -> Any:
    """Load what `save_params` wrote; with a template the result has its structure and shardings."""
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(directory), _abstract(template) if template is not None else None)
