"""The train job end to end at tiny size: outputs, resume equality (past a damaged checkpoint), SIGTERM, NaN
stops, bad inputs, and the 8-device run agreeing with one device. The methods' runs are in test_train_methods.py
(a file of their own, so that pytest-xdist's two workers share the train runs)."""
import hashlib
import json
import os
import shutil
import signal

import chex
import jax
import numpy as np
import pytest

from flowrl_jax import checkpoint, main, parallel, rewards
from flowrl_jax.worlds.shapes import assets
from flowrl_jax.config_lib import ConfigError
from tests.conftest import load_config

TINY = {"sampler.num_steps": 3, "train.iterations": 4, "train.prompts_per_iteration": 2, "train.group_size": 4,
        "train.minibatches": 2, "train.lr": 1e-3, "objective.grpo.clip_range": 0.2, "eval.at_start": False, "eval.every": 0,
        "eval.per_category": 1, "eval.num_steps": 2, "eval.batch_size": 8, "checkpoint.every": 1,
        "train.lora_rank": 0, "sampler.sde_window": (), "train.ema_every": 1,  # the whole DiT, every step trained
        "diagnostics.image_change_every": 0}  # three more rollouts to compile per run: only where a test checks them


def _run(base_workdir, workdir, **fields):
    return main.run_job(load_config("configs/flow_grpo.py", **{"world.base": base_workdir, **TINY, **fields}), str(workdir))


def _state(workdir, step=None):
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        return ckpt.restore(step or ckpt.latest_step(), None)[0]
    finally:
        ckpt.close()


def test_train_writes_tables_metrics_grids_and_report(smoke_base, tmp_path, capsys):
    # JPEG compressibility, continuous: the smoke base's images may all score 0 on the shapes reward, and then no sample
    # carries an advantage and no update runs
    out = _run(smoke_base, tmp_path, **{"train.iterations": 2, "eval.at_start": True, "train.ema_every": 8, "diagnostics.image_change_every": 2,
                                        "train.rewards": (("jpeg_compressibility", 1.0),)})
    assert out["step"] == 2 and [e["step"] for e in out["evals"]] == [0, 2]
    for name in ("eval.json", "report.png", "eval_000000.png", "eval_000002.png", "metrics.jsonl"):
        assert os.path.isfile(tmp_path / name), name
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train_rows = [r for r in rows if "reward" in r]
    assert len(train_rows) == 2 and {"clipfrac", "approx_kl", "kl", "grad_norm", "update_norm", "param_norm",
                                     "ratio_mean/step_0", "ratio_std/step_2", "clipfrac/step_1", "alignment_heldout"} <= set(train_rows[0])
    # The same-noise change (the last iteration): every step is trained here, so all of it comes through trained steps;
    # the two rollouts differ only in how XLA compiles the same velocity (inside lax.cond or not), float32 rounding of
    # O(1) latents over 3 steps: 1e-6.
    change = train_rows[-1]
    assert change["image_change/total"] > 1e-4 and abs(change["image_change/trained_steps"] - change["image_change/total"]) < 1e-6
    assert change["image_change/untrained_steps"] < 1e-6
    assert "GenEval-style table, step 0 -> 2" in capsys.readouterr().out
    state = _state(str(tmp_path))
    _, base_params, _ = assets.load_pipeline(smoke_base)
    moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), state["params"], base_params["dit"])
    assert max(jax.tree_util.tree_leaves(moved)) > 1e-4  # the policy was updated
    # EMA every 8 optimizer steps (Flow-GRPO's cadence): after 2 iterations x 2 minibatches it has not moved yet
    chex.assert_trees_all_equal(state["ema"], jax.tree_util.tree_map(np.asarray, base_params["dit"]))


def _damage(step_folder):
    """Overwrite every stored array file of a checkpoint step (what a disk fault or a killed copy leaves)."""
    for root, _, files in os.walk(step_folder):
        for f in files:
            if "ocdbt" in root or f.endswith("manifest.ocdbt"):
                with open(os.path.join(root, f), "wb") as out:
                    out.write(b"\0" * 16)


def test_resume_equals_uninterrupted_run_and_skips_a_damaged_checkpoint(smoke_base, tmp_path, capsys):
    _run(smoke_base, tmp_path / "full")
    _run(smoke_base, tmp_path / "part", **{"train.iterations": 2})
    _damage(tmp_path / "part" / "checkpoints" / "2")  # the newest step is damaged: resume from step 1, keep step 2's files
    capsys.readouterr()
    out = _run(smoke_base, tmp_path / "part")
    assert out["step"] == 4
    printed = capsys.readouterr()
    assert "checkpoint step 2" in printed.out and "damaged" in printed.out and "resumed from step 1" in printed.out
    assert "Event loop is closed" not in printed.out + printed.err
    assert os.path.isdir(tmp_path / "part" / "checkpoints" / "2.damaged")  # set aside, not deleted
    chex.assert_trees_all_equal(_state(str(tmp_path / "full")), _state(str(tmp_path / "part")))  # bit-exact


def _patched_reward(monkeypatch, on_call):
    real = rewards.REWARDS["shapes_score"]()
    calls = []

    def reward(images, prompts):
        calls.append(1)
        return on_call(len(calls), real(images, prompts))

    monkeypatch.setitem(rewards.REWARDS, "shapes_score", lambda: reward)


def test_sigterm_skips_the_due_eval_saves_and_the_resumed_run_evaluates_that_step_first(smoke_base, tmp_path, monkeypatch):
    def on_call(n, r):
        if n == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return r

    _patched_reward(monkeypatch, on_call)
    # every_s: a save after every iteration by the wall-clock cadence alone (checkpoint.every=100 would save none)
    out = _run(smoke_base, tmp_path, **{"checkpoint.every": 100, "checkpoint.every_s": 1e-9, "eval.every": 2})
    assert out["stopped"] == "SIGTERM" and out["step"] == 2 and out["resumable"]  # main exits 75 (test_main)
    assert out["evals"] == []  # step 2's eval was due, and skipped: the notice leaves seconds, not an eval's minutes
    ckpt = checkpoint.Checkpointer(os.path.join(tmp_path, "checkpoints"))
    assert ckpt.all_steps() == [1, 2]  # step 1 by every_s, step 2 by the signal
    ckpt.close()
    monkeypatch.undo()
    resumed = _run(smoke_base, tmp_path, **{"checkpoint.every": 100, "eval.every": 2, "train.iterations": 2})  # no iteration left
    assert [e["step"] for e in resumed["evals"]] == [2] and not resumed["resumable"]  # the skipped eval, first thing


def test_time_budget_stops_once_reached_after_the_compiling_iteration_with_an_eval_and_a_checkpoint(smoke_base, tmp_path, capsys):
    out = _run(smoke_base, tmp_path, **{"train.time_budget_s": 1e-9, "checkpoint.every": 100})
    # the first (compiling) iteration is not counted, so any budget > 0 is first reached after iteration 2 of the 4
    assert out["stopped"] == "time_budget" and out["step"] == 2 and out["wall_s"] > out["first_iteration_s"]
    assert [e["step"] for e in out["evals"]] == [2]  # the stop is the run's end: it evaluates (eval.every=0 here)
    assert _state(str(tmp_path), 2) is not None
    assert "train.time_budget_s=1e-09 reached after 2 iterations" in capsys.readouterr().out


def test_nan_reward_stops_naming_step_and_quantity_and_keeps_the_last_checkpoint(smoke_base, tmp_path, monkeypatch):
    _patched_reward(monkeypatch, lambda n, r: r * np.nan if n == 3 else r)
    with pytest.raises(FloatingPointError, match="reward .* not finite at step 3.*step 2"):
        _run(smoke_base, tmp_path)
    ckpt = checkpoint.Checkpointer(os.path.join(tmp_path, "checkpoints"))
    assert ckpt.latest_step() == 2
    ckpt.close()


def _digest(folder):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            h.update(f.encode() + open(os.path.join(root, f), "rb").read())
    return h.hexdigest()


def test_bad_inputs_are_one_line_errors_and_nothing_saved_changes(smoke_base, tmp_path):
    workdir = tmp_path / "run"
    _run(smoke_base, workdir, **{"train.iterations": 1})
    before = _digest(workdir)
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("\n")
    bad.write_text('{"prompt": "a circle", "category": "single_object", "spec": {}}\nnot json\n')
    corrupt = tmp_path / "corrupt_base"
    shutil.copytree(smoke_base, corrupt)
    for root, _, files in os.walk(corrupt / "checkpoints"):
        for f in files:
            if "ocdbt" in root or f.endswith("manifest.ocdbt"):
                open(os.path.join(root, f), "wb").close()  # truncate the stored arrays
    cases = [({"world.train_prompts": str(empty)}, "is empty"),
             ({"world.train_prompts": str(bad)}, "line 2 is not JSON"),
             ({"world.test_prompts": str(tmp_path / "missing.jsonl")}, "not found"),
             ({"train.rewards": (("no_such_reward", 1.0),)}, "unknown reward.*no_such_reward.*known rewards"),
             ({"credit.names": ("nope",)}, "unknown credit scheme"),
             ({"world.base": str(tmp_path / "no_base")}, "cannot load the base model"),
             ({"world.base": str(corrupt)}, "cannot load the base model"),
             ({"sampler.kind": "ode"}, "cannot be trained on"),
             ({"train.lr_schedule": "linear"}, "lr_schedule='linear' is not a schedule"),
             ({"train.rewards": (("ocr", 1.0),)}, "prompts have no text between double quotes"),  # the shapes prompts
             ({"train.rewards": (("remote:ocr@ftp://host", 1.0),)}, "write it as remote:NAME@http://HOST:PORT"),
             ({"train.remote_rewards.deadline_s": -1.0}, "must be positive"),
             ({"train.score_while_sampling": True}, "set train.rollout_chunk")]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            _run(smoke_base, workdir, **fields)
        assert "\n" not in str(e.value)
    assert _digest(workdir) == before


def test_eight_device_run_agrees_with_one_device(smoke_base, tmp_path, monkeypatch):
    fields = {"train.iterations": 1, "mesh": (("data", 4), ("fsdp", 2)), "min_fsdp_size": 64, "sampler.num_steps": 2,
              "eval.num_steps": 1, "train.rewards": (("jpeg_compressibility", 1.0),)}  # continuous: an update always runs
    fields["eval.at_start"] = False
    _run(smoke_base, tmp_path / "eight", **fields)
    real = parallel.make_mesh
    monkeypatch.setattr(parallel, "make_mesh", lambda axes: real((("data", 1), ("fsdp", 1)), devices=jax.devices()[:1]))
    _run(smoke_base, tmp_path / "one", **fields)
    rows = [[json.loads(line) for line in open(tmp_path / d / "metrics.jsonl") if "reward" in line][0] for d in ("eight", "one")]
    # rtol 2e-3: loss, kl and grad_norm are float32 sums over up to ~16k terms (the tiny DiT's elements for grad_norm)
    # reduced in another order over 8 devices, |delta| <= K eps sum|terms| = 16e3 x 1.2e-7 ~ 2e-3 relative at worst
    # (measured ~1e-6); rewards and clipfrac are thresholded and equal unless a value sits on a threshold. A sharding
    # bug (a wrong batch row, an unreduced gradient) moves them by O(1).
    for key in ("reward", "loss", "policy_loss", "kl", "clipfrac", "grad_norm"):
        np.testing.assert_allclose(rows[0][key], rows[1][key], rtol=2e-3, atol=1e-6, err_msg=key)
    eight, one = _state(str(tmp_path / "eight")), _state(str(tmp_path / "one"))
    # Adam's first step is ~lr * sign(g): where a gradient is ~0, float-level differences between the two
    # reductions flip the sign of that element's step. Bound it: every element within one step's size (2 lr)
    # and all but a handful of elements (< 0.5%) equal to 1e-5.
    diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                            for a, b in zip(jax.tree_util.tree_leaves(eight["params"]), jax.tree_util.tree_leaves(one["params"]))])
    assert diffs.max() <= 2 * TINY["train.lr"] and np.mean(diffs > 1e-5) < 0.005


OLD_CHECKPOINT = os.path.join(os.path.dirname(__file__), "data", "checkpoint_before_issue40")


def test_a_checkpoint_written_before_the_move_of_issue_40_resumes(tmp_path, capsys):
    """A LoRA run's step-2 checkpoint written by the code before the jobs and the RL loop moved (commit 0c45904,
    `tests/data/make_checkpoint_before_issue40.py`): today's train job restores it into its TrainState and trains on."""
    workdir = tmp_path / "run"
    shutil.copytree(OLD_CHECKPOINT, workdir)
    fields = {"world.base": "shapes32", "sampler.num_steps": 3, "train.iterations": 3, "train.prompts_per_iteration": 2,
              "train.group_size": 4, "train.minibatches": 2, "train.lora_rank": 2, "eval.at_start": False, "eval.every": 0,
              "eval.per_category": 1, "eval.num_steps": 2, "eval.batch_size": 8, "checkpoint.every": 1,
              "diagnostics.image_change_every": 0, "sampler.sde_window": (0, 2)}  # as the script wrote it, one iteration more
    out = main.run_job(load_config("configs/flow_grpo.py", **fields), str(workdir))
    assert out["step"] == 3 and "resumed from step 2" in capsys.readouterr().out
    saved = np.load(os.path.join(OLD_CHECKPOINT, "params_step2.npz"))
    restored = _state(str(workdir), 2)["params"]  # step 2's files as the old code wrote them, untouched by the resume
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(restored)}
    assert sorted(flat) == sorted(saved.files)
    for name in saved.files:
        np.testing.assert_array_equal(flat[name], saved[name])  # bit-equal: orbax stores the float32 arrays as they are


def test_report_draws_each_world_s_own_eval_curves(tmp_path):
    """report.png plots the world's eval curves (`World.eval_curves`): an SD3 run's eval reward, a shapes run's overall
    strict and score; a world's curves that the metrics lack are not drawn."""
    from flowrl_jax import metrics
    from flowrl_jax.worlds.sd3 import SD3World
    from flowrl_jax.worlds.shapes import ShapesWorld

    writer = metrics.MetricWriter(str(tmp_path))
    for step in (1, 2, 3):
        writer.scalars(step, {"reward": 0.1 * step, "wall_s": 10.0 * step})
    for step in (0, 3):
        writer.scalars(step, {"eval/reward": 0.2 + step, "wall_s": 10.0 * step})
    writer.close()
    drawn = metrics.plot_report(str(tmp_path), str(tmp_path / "report.png"), SD3World.eval_curves)
    assert drawn == {"train reward (mean)": 3, "eval reward (test prompts)": 2} and os.path.isfile(tmp_path / "report.png")
    assert metrics.plot_report(str(tmp_path), str(tmp_path / "shapes.png"), ShapesWorld.eval_curves) == {"train reward (mean)": 3}


def test_a_failing_metrics_write_is_retried_then_dropped_with_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from flowrl_jax import metrics, paths

    writer, calls, real = metrics.MetricWriter(str(tmp_path)), [], paths.append_line

    def flaky(path, line):  # a bucket's transient 5xx twice, then the write goes through
        calls.append(line)
        if len(calls) <= 2:
            raise OSError("503 Service Unavailable")
        real(path, line)

    monkeypatch.setattr(metrics, "WRITE_BACKOFF_S", 0.0)
    monkeypatch.setattr(paths, "append_line", flaky)
    writer.scalars(1, {"loss": 0.5})
    assert len(calls) == 3 and [r["loss"] for r in metrics.read_metrics(str(tmp_path))] == [0.5]
    monkeypatch.setattr(paths, "append_line", lambda path, line: (_ for _ in ()).throw(OSError("503 Service Unavailable")))
    writer.scalars(2, {"loss": 0.25})  # every try fails: no exception, one warning naming the row and the error
    writer.close()
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1]
    err = capsys.readouterr().err
    assert "the metrics row of step 2" in err and "failed 3 times (OSError: 503 Service Unavailable)" in err
