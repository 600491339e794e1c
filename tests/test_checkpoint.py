"""Checkpointer: a damaged newest step is skipped and set aside (never deleted), every step damaged is one
quiet line, no orbax event-loop noise, and a flax.struct.dataclass train state round-trips bit-exactly."""
import gc
import hashlib
import os
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from flowrl_jax.checkpoint import CheckpointError, Checkpointer


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    updates: jax.Array
    params: Any
    ema: Any
    opt_state: Any
    credit: dict
    old: Any = None
    curriculum: Any = None


@pytest.fixture
def quiet(monkeypatch, capfd):
    """Records unraisable exceptions (orbax's "Event loop is closed") and checks, after the test body, that
    there were none and that nothing reached stderr."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    yield
    time.sleep(0.3)  # reads left in flight by a failed restore call back within milliseconds
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in seen] == []
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err[:2000]


def _state(step, leaves=40):
    """Many small leaves, so a failing orbax restore has reads in flight when it gives up."""
    return {"step": jnp.int32(step), "params": {f"w{i}": jnp.arange(64, dtype=jnp.float32) * (step + i) for i in range(leaves)}}


def _save_steps(directory, steps=(1, 2, 3)):
    with Checkpointer(directory) as ckpt:
        for s in steps:
            ckpt.save(s, _state(s), {"step": s})


def _damage(folder, kind):
    """'ocdbt': overwrite every file under state/ with "ocdbt" in its path; 'd': truncate the data files (d/)."""
    hit = 0
    for root, _, files in os.walk(os.path.join(folder, "state")):
        for f in files:
            path = os.path.join(root, f)
            if kind == "ocdbt" and "ocdbt" in path:
                open(path, "wb").write(b"garbage")
            elif kind == "d" and os.path.basename(root) == "d":
                open(path, "r+b").truncate(os.path.getsize(path) // 2)
            else:
                continue
            hit += 1
    assert hit >= 2


def _digest(folder):
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            h.update(os.path.relpath(path, folder).encode() + open(path, "rb").read())
    return h.hexdigest()


def _assert_equal(a, b):
    """Same tree structure (types included) and bit-equal leaves of the same dtype."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_no_checkpoint_yet(tmp_path, quiet):
    with Checkpointer(str(tmp_path / "checkpoints")) as ckpt:
        assert ckpt.restore_latest(_state(0)) == (None, None, [])
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None


@pytest.mark.parametrize("kind", ["ocdbt", "d"])
def test_damaged_newest_step_is_skipped_set_aside_and_its_number_saved_again(tmp_path, kind, quiet):
    directory = str(tmp_path)
    _save_steps(directory)
    _damage(os.path.join(directory, "3"), kind)
    damaged = _digest(os.path.join(directory, "3"))
    with Checkpointer(directory, max_to_keep=3) as ckpt:
        assert ckpt.damage(2) is None and ckpt.damage(3)
        state, meta, skipped = ckpt.restore_latest(_state(0))
        _assert_equal(state, _state(2))
        assert meta == {"step": 2}
        moved = os.path.join(directory, "3.damaged")
        assert [s for s, _ in skipped] == [3] and "\n" not in skipped[0][1] and skipped[0][1].endswith(f"moved to {moved}")
        assert ckpt.all_steps() == [1, 2] and _digest(moved) == damaged
        ckpt.save(3, _state(30), {"step": 3})  # the resumed run reaches the damaged step's number again
        ckpt.save(4, _state(4), {"step": 4})  # keep-3 deletes step 1, never the set-aside folder
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [2, 3, 4]
        _assert_equal(ckpt.restore(3, _state(0))[0], _state(30))
    assert sorted(os.listdir(directory)) == ["2", "3", "3.damaged", "4"] and _digest(moved) == damaged


def test_set_aside_name_already_taken(tmp_path, quiet):
    directory = str(tmp_path)
    _save_steps(directory, (1, 2))
    os.makedirs(os.path.join(directory, "2.damaged"))
    _damage(os.path.join(directory, "2"), "d")
    with Checkpointer(directory) as ckpt:
        _, meta, skipped = ckpt.restore_latest(_state(0))
    assert meta == {"step": 1} and skipped[0][1].endswith(os.path.join(directory, "2.damaged-2"))


def test_every_step_damaged_is_one_quiet_line_and_nothing_moves(tmp_path, quiet):
    directory = str(tmp_path)
    _save_steps(directory)
    for s, kind in ((1, "d"), (2, "ocdbt"), (3, "d")):
        _damage(os.path.join(directory, str(s)), kind)
    before = _digest(directory)
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError) as e:
            ckpt.restore_latest(_state(0))
        message = str(e.value)
        assert "\n" not in message and directory in message and "move the damaged step folders away" in message
        assert all(f"step {s}:" in message for s in (1, 2, 3))
        with pytest.raises(ValueError, match="step 3 .* is damaged"):  # the template-less path assets use
            ckpt.restore(3, None)
        with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
            ckpt.restore(7, None)
    assert _digest(directory) == before and sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_save_restore_close_cycles_leave_no_event_loop_noise(tmp_path, quiet):
    directory = str(tmp_path)
    for s in (1, 2, 3):
        ckpt = Checkpointer(directory)
        if s > 1:
            _assert_equal(ckpt.restore(s - 1, None)[0], _state(s - 1))
            _assert_equal(ckpt.restore_latest(_state(0))[0], _state(s - 1))
        ckpt.save(s, _state(s), {"step": s})
        ckpt.close()
        ckpt.close()  # idempotent
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
    ckpt.close()  # after the with block: still fine


def _train_state(mesh, optional):
    fsdp, replicated = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P())
    params = {"dense": {"kernel": jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (16, 8)), fsdp),
                        "bias": jax.device_put(jnp.linspace(-1, 1, 8), replicated)}}
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    _, opt_state = opt.update(params, opt_state, params)  # non-zero moments and count
    state = TrainState(step=jnp.int32(5), updates=jnp.int32(10), params=params,
                       ema=jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params), opt_state=opt_state,
                       credit={"adaptive": {"count": jnp.int32(2), "mean": jnp.float32(0.25)}})
    if optional:
        state = state.replace(old=jax.tree_util.tree_map(lambda x: x * 0.5, params),
                              curriculum={"count": jnp.arange(6, dtype=jnp.int32)})
    return state


@pytest.mark.parametrize("optional", [False, True], ids=["old_none", "old_set"])
def test_train_state_dataclass_round_trips(tmp_path, optional, quiet):
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), devices=jax.devices())
    state = _train_state(mesh, optional)
    assert state.params["dense"]["kernel"].sharding.spec == P("fsdp", None)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state, {"step": 1})
    with Checkpointer(str(tmp_path)) as ckpt:
        restored, meta, skipped = ckpt.restore_latest(_train_state(mesh, optional))  # a fresh state as template
        assert type(restored) is TrainState and type(restored.opt_state[0]) is optax.ScaleByAdamState
        assert meta == {"step": 1} and skipped == []
        _assert_equal(restored, state)
        assert all(r.sharding == s.sharding for r, s in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)))
        assert (restored.old is None) is (not optional) and (restored.curriculum is None) is (not optional)
        # another sharding in the template: the same values, laid out as the template asks
        single = jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), state)
        moved, _ = ckpt.restore(1, single)
        _assert_equal(moved, state)
        assert moved.params["dense"]["kernel"].sharding == single.params["dense"]["kernel"].sharding
        # no template: a dict keyed by field name (None fields stay None), namedtuples as dicts
        plain, _ = ckpt.restore(1, None)
    assert type(plain) is dict and set(plain) == {f.name for f in TrainState.__dataclass_fields__.values()}
    _assert_equal(plain["params"], state.params)
    _assert_equal(plain["credit"], state.credit)
    np.testing.assert_array_equal(plain["opt_state"][0]["nu"]["dense"]["kernel"], state.opt_state[0].nu["dense"]["kernel"])
    assert int(plain["opt_state"][0]["count"]) == 1 and plain["ema"]["dense"]["bias"].dtype == jnp.bfloat16
    if optional:
        _assert_equal(plain["old"], state.old)
        _assert_equal(plain["curriculum"], state.curriculum)
    else:
        assert plain["old"] is None and plain["curriculum"] is None
