"""Assets end to end on a tiny pretrained model (export -> manifest -> load by name -> eval job ->
reward training), plus the shipped `shapes32` base model and `shapes32_reward` learned reward."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowrl_jax import main
from flowrl_jax.worlds.shapes import assets, geneval, learned, evaluator
from flowrl_jax.data import shapes
from flowrl_jax.models.text import tokenize
from flowrl_jax.jobs.train_reward import pearson
from tests.conftest import load_config

SHIPPED_DIR = assets.ASSET_DIR  # the smoke_asset fixture points assets.ASSET_DIR elsewhere while it lives


@pytest.fixture
def shipped_dir(monkeypatch):
    monkeypatch.setattr(assets, "ASSET_DIR", SHIPPED_DIR)
    return SHIPPED_DIR


def _shipped(name):
    return pytest.mark.skipif(not os.path.isdir(os.path.join(assets.ASSET_DIR, name)), reason=f"asset {name} is not shipped yet")


@pytest.fixture(scope="module")
def smoke_asset(tmp_path_factory, smoke_base):
    """The smoke pretrain run (conftest) exported as asset 'smoke' into a temporary asset folder."""
    root = tmp_path_factory.mktemp("assets")
    workdir = smoke_base
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(assets, "ASSET_DIR", str(root / "shipped"))
        table = main.run_job(load_config("configs/export_shapes32.py", **{"export.workdir": workdir, "export.name": "smoke",
                                                                      "export.eval.samples_per_prompt": 1, "export.eval.batch_size": 140,
                                                                      "export.eval.num_steps": 2}), str(root))
        yield {"root": root, "workdir": workdir, "folder": root / "shipped" / "smoke", "table": table}


def test_export_writes_a_verified_asset_with_its_measured_table(smoke_asset):
    manifest = assets.verify(str(smoke_asset["folder"]))
    assert manifest["training_steps"] == 6 and manifest["test_eval"] == smoke_asset["table"]
    assert set(manifest["test_eval"]) == set(shapes.CATEGORIES) | {"overall"}
    assert "params/manifest.ocdbt" in manifest["files"] and "tokenizer/tokenizer.json" in manifest["files"]
    pipe, params, info = assets.load_pipeline("smoke")
    leaves = jax.tree_util.tree_leaves(params)
    assert all(x.dtype == jnp.float32 for x in leaves)  # stored as bfloat16, loaded as float32
    _, ema, _ = assets.load_pipeline(smoke_asset["workdir"], use_ema=True)
    for a, b in zip(leaves, jax.tree_util.tree_leaves(ema)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-6)  # bfloat16 rounding only


def test_eval_job_writes_table_and_grid(smoke_asset, tmp_path):
    config = load_config("configs/eval_shapes.py", **{"eval.checkpoint": "smoke", "eval.max_prompts": 12, "eval.batch_size": 12,
                                                  "eval.num_steps": 2, "eval.samples_per_prompt": 1})
    table = main.run_job(config, str(tmp_path))
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert set(saved["table"]) == {"single_object", "overall"}  # the first 12 test prompts are single_object
    assert saved["table"] == table and (tmp_path / "eval_grid.png").exists()


def test_altered_or_missing_asset_files_are_named(smoke_asset, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(smoke_asset["folder"], folder)
    (folder / "model.json").write_text((folder / "model.json").read_text() + " ")
    (folder / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(assets.AssetError, match=r"missing \['tokenizer/tokenizer.json'\], altered \['model.json'\]"):
        assets.verify(str(folder))
    (folder / "MANIFEST.json").unlink()
    with pytest.raises(assets.AssetError, match="MANIFEST.json is missing"):
        assets.verify(str(folder))


def test_unknown_checkpoint_name_lists_the_shipped_ones(smoke_asset):
    with pytest.raises(FileNotFoundError, match="smoke"):
        assets.load_pipeline("no_such_model")


def test_train_reward_smoke(smoke_asset, tmp_path):
    config = load_config("configs/train_reward.py", "smoke", **{"reward.base": smoke_asset["workdir"]})
    result = main.run_job(config, str(tmp_path))
    assert result["n_train"] == 64 + 16 and result["train_sources"]["generated"] == 16 and result["n_heldout"] == 16
    assert np.isfinite(result["mse_heldout"])
    assert json.loads((tmp_path / "reward_eval.json").read_text()) == result


@_shipped("shapes32")
def test_shipped_base_model_samples_a_batch(shipped_dir):
    pipe, params, info = assets.load_pipeline("shapes32")
    prompts = [p for p in shapes.load_prompts("test") if p["category"] == "colors"][:8]
    ids, mask = pipe.tokenize([p["prompt"] for p in prompts])
    cfg = info["manifest"]["test_eval_settings"]["cfg"]
    images = np.asarray(geneval.make_sampler(pipe, 20, cfg, 1.0)(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(0)))
    assert images.shape == (8, 32, 32, 3) and np.isfinite(images).all()
    detections = evaluator.evaluate(images, [p["spec"] for p in prompts])["detections"]
    assert sum(any(d["shape"] for d in dets) for dets in detections) >= 5  # a trained model draws shapes


# Regression bars on the shipped 256 + 256 held-out samples, measured 0.855 (test prompts) and 0.819 (train prompts,
# new seeds) with the mirror average; on the full 960 + 960 the job measured 0.856 / 0.833. The bar is 0.8: see
# WORKSPACE_NOTES.md, "Learned reward".
BARS = {"test_prompts": 0.83, "train_prompts": 0.8}


@_shipped("shapes32_reward")
def test_learned_reward_tracks_the_exact_score_on_held_out_base_samples(shipped_dir):
    reward, params, tokenizer, manifest = learned.load("shapes32_reward")
    held = np.load(os.path.join(shipped_dir, "shapes32_reward", "heldout.npz"))
    images = held["images"].astype(np.float32) / 127.5 - 1.0
    prompts = [str(p) for p in held["prompts"]]
    exact = evaluator.evaluate(images, prompts)["score"]  # recomputed here, independently of training
    ids, mask = tokenize(tokenizer, prompts, reward.max_len)
    predicted = np.asarray(jax.jit(reward.apply)({"params": params}, images, ids, mask))
    for split, bar in BARS.items():
        sel = held["split"] == split
        assert sel.sum() == 256 and exact[sel].std() > 0.1  # the held-out set spans good and bad samples
        assert pearson(predicted[sel], exact[sel]) >= bar, split
    grad = jax.grad(lambda x: reward.apply({"params": params}, x, ids[:4], mask[:4]).sum())(jnp.asarray(images[:4]))
    assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad).max()) > 0  # differentiable w.r.t. pixels
