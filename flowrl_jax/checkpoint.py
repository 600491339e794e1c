"""Orbax checkpoints: save, keep-N, resume from the latest good step, restore a state pytree by template.

    with Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=3) as ckpt:
        state, meta, skipped = ckpt.restore_latest(template)   # (None, None, []) when there is none yet
        ckpt.save(step, state, meta={"config": ...})            # async; close() (or leaving `with`) waits

A checkpoint is `args.Composite(state=StandardSave(pytree), meta=JsonSave(dict))`. Restoring into
`template` (arrays or `jax.ShapeDtypeStruct`s, with shardings; dicts or `flax.struct.dataclass`es) gives
the same structure back, sharded like the template; without a template a dataclass comes back as a dict
keyed by field name (namedtuples as dicts, an optax `EmptyState` as None).

Before orbax reads a step, every array of it is read and decoded here, synchronously: a damaged file
(truncated, overwritten) is a one-line `CheckpointError` instead of an orbax error that leaves reads in
flight, whose callbacks then print "RuntimeError: Event loop is closed" tracebacks into a closed loop.
`restore_latest` skips damaged steps, newest first, and renames their folders to `<step>.damaged`
(not a step name to orbax: `all_steps()` matches `^(0|[1-9]\\d*)$`), so the run resumes from the
newest good step and can save the damaged step's number again; nothing is deleted.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from flowrl_jax import parallel, paths

DAMAGED_SUFFIX = ".damaged"
DECISION_SLOTS = 64  # the restore choice process 0 broadcasts: the step and up to 63 damaged ones it set aside


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored (damaged files); one line. A ValueError, like orbax's own."""


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) if hasattr(x, "shape") else x, tree)


def _local(item_metadata) -> Any:
    """A restore template from a saved tree's metadata: every array on this process's first device. Orbax
    refuses a template-less restore on another topology (a CPU-saved asset on a GPU: "Topology mismatch")."""
    tree = item_metadata.tree if hasattr(item_metadata, "tree") else item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)


def _one_line(e: BaseException) -> str:
    """The first line of an error, without tensorstore's spec dump, at most 300 characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" [tensorstore_spec")[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _read_arrays(item: str) -> None:
    """Read and decode every array of an orbax OCDBT item folder (zarr or zarr3 arrays), one at a time."""
    if not paths.exists(os.path.join(item, "manifest.ocdbt")):
        raise FileNotFoundError(f"{os.path.join(item, 'manifest.ocdbt')} is missing")
    kvstore = {"driver": "ocdbt", "base": paths.kvstore_url(item)}
    for key in sorted(ts.KvStore.open(kvstore).result().list().result()):
        for marker, driver in ((b"/.zarray", "zarr"), (b"/zarr.json", "zarr3")):
            if key.endswith(marker):  # synchronous: when one fails, no read is left in flight
                spec = {"driver": driver, "kvstore": {**kvstore, "path": key[: -len(marker)].decode() + "/"}}
                ts.open(spec, open=True, read=True).result().read().result()


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = paths.resolve(directory)  # a local folder or a bucket URL (gs://...)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._closed = False

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict | None = None, force: bool = False) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta or {}))
        self.manager.save(step, args=args, force=force)

    def damage(self, step: int) -> str | None:
        """Why step `step` cannot be read (one line), or None when its metadata and every array read back."""
        self.manager.wait_until_finished()  # a step still being written is not damaged
        folder = os.path.join(self.directory, str(step))
        try:
            for name in ("meta/metadata", "state/_METADATA"):
                with paths.open_file(os.path.join(folder, name)) as f:
                    json.load(f)
            _read_arrays(os.path.join(folder, "state"))
        except Exception as e:  # noqa: BLE001 - any read error means damaged
            return _one_line(e)
        return None

    def restore(self, step: int, template: Any) -> tuple[Any, dict]:
        """(state, meta) of `step`; a damaged step is a CheckpointError (nothing is moved)."""
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        reason = self.damage(step)
        if reason is not None:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged ({reason}); "
                                  f"move the damaged step folder away to use another step")
        return self._restore(step, template)

    def _restore(self, step: int, template: Any) -> tuple[Any, dict]:
        if template is None:  # the saved tree's own metadata (the manager's item_metadata is empty under multi-process)
            with ocp.StandardCheckpointer() as reader:
                target = _local(reader.metadata(os.path.join(str(self.directory), str(step), "state")).item_metadata)
        else:
            target = _abstract(template)
        state = ocp.args.StandardRestore(target)
        out = self.manager.restore(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_latest(self, template: Any) -> tuple[Any, dict, list[tuple[int, str]]] | tuple[None, None, list]:
        """(state, meta, skipped) of the newest step that reads back; `skipped` lists the newer damaged steps as
        (step, reason), their folders renamed to `<step>.damaged` (named in the reason). (None, None, []) when
        there is no checkpoint; CheckpointError (nothing renamed) when every step is damaged.

        With several processes, process 0 alone reads the steps, chooses one and renames the damaged folders; the
        others wait at a barrier, receive its choice and restore that same step (their reasons read "see process 0")."""
        steps = self.all_steps()
        chosen, skipped = -1, []
        if jax.process_index() == 0:
            for step in reversed(steps):
                reason = self.damage(step)
                if reason is None:
                    chosen = step
                    break
                skipped.append((step, reason))
            if chosen >= 0:
                skipped = [(s, f"{r}; moved to {self._set_aside(s)}") for s, r in skipped]
        # [chosen, skipped steps..., -1 padding], one broadcast of a fixed size (a bucket's listing may differ by host)
        decision = np.full(DECISION_SLOTS, -1, np.int64)
        decision[0] = chosen
        listed = [s for s, _ in skipped][: DECISION_SLOTS - 1]
        decision[1 : 1 + len(listed)] = listed
        decision = parallel.from_process_0(decision)
        parallel.barrier("flowrl_checkpoint_chosen")  # the renames are done before anyone lists the folder again
        chosen = int(decision[0])
        if jax.process_index() != 0:
            skipped = [(int(s), "see process 0's log") for s in decision[1:] if s >= 0]
        self.manager.reload()
        if chosen >= 0:
            state, meta = self._restore(chosen, template)
            return state, meta, skipped
        if steps:
            damaged = "; ".join(f"step {s}: {r}" for s, r in skipped)
            raise CheckpointError(f"no checkpoint in {self.directory} can be restored, every step is damaged ({damaged}); "
                                  "move the damaged step folders away to start afresh")
        return None, None, []

    def restore_fields(self, step: int, fields: tuple[str, ...]) -> tuple[dict, dict]:
        """({field: that subtree of the saved state as host numpy arrays}, meta) of `step`, the other fields not read and
        no array placed on a device: what an export or a sample job needs from a train state (`rl/trained.py`)."""
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        reason = self.damage(step)
        if reason is not None:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged ({reason})")
        path = os.path.join(str(self.directory), str(step), "state")
        with ocp.PyTreeCheckpointer() as reader:
            saved = reader.metadata(path).item_metadata
            tree = saved.tree if hasattr(saved, "tree") else saved
            missing = [f for f in fields if f not in tree]
            if missing:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} has no {missing} (it has {sorted(tree)})")
            item = {f: jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree[f]) for f in fields}
            restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            out = reader.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
        with paths.open_file(os.path.join(str(self.directory), str(step), "meta", "metadata")) as f:
            meta = json.load(f)
        return {f: out[f] for f in fields}, meta

    def _set_aside(self, step: int) -> str:
        """Rename a damaged step folder to `<step>.damaged` (`-2`, `-3`, ... if taken); its new path (process 0)."""
        folder = os.path.join(self.directory, str(step))
        target, n = folder + DAMAGED_SUFFIX, 1
        while paths.exists(target):
            n += 1
            target = f"{folder}{DAMAGED_SUFFIX}-{n}"
        paths.rename(folder, target)
        return target

    def close(self) -> None:
        """Wait for pending saves and close; a second call does nothing."""
        if not self._closed:
            self._closed = True
            self.manager.close()  # waits for pending saves first


def save_params(directory: str, params: Any) -> None:
    """One-off save of a params pytree (shipped assets): a plain orbax StandardCheckpointer folder."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(paths.resolve(directory), params, force=True)


def load_params(directory: str, template: Any | None = None) -> Any:
    """Load what `save_params` wrote; with a template the result has its structure and shardings, without
    one every array is on this process's first device (whatever topology saved it)."""
    path = paths.resolve(directory)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, _abstract(template) if template is not None else _local(ckptr.metadata(path).item_metadata))
