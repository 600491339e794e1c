"""The shipped assets: the base model samples, the eval job reports, the learned reward tracks the
exact score, and a damaged asset is a clear error."""
import json
import runpy
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowrl_jax import assets, evaluate, main
from flowrl_jax.data import shapes
from flowrl_jax.rewards import shapes_eval
from flowrl_jax.train_reward import pearson


@pytest.fixture(scope="module")
def base():
    return assets.load_pipeline("shapes32")


def test_shipped_base_model_samples_a_batch(base):
    pipe, params, info = base
    assert info["manifest"]["test_eval"]["overall"]["strict"] >= 0.25
    prompts = [p for p in shapes.load_prompts("test") if p["category"] == "colors"][:8]
    ids, mask = pipe.tokenize([p["prompt"] for p in prompts])
    images = np.asarray(evaluate.make_sampler(pipe, 20, 4.0, 1.0)(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(0)))
    assert images.shape == (8, 32, 32, 3) and np.isfinite(images).all()
    # a trained model draws objects: the exact evaluator finds shapes in most samples
    detections = shapes_eval.evaluate(images, [p["spec"] for p in prompts])["detections"]
    assert sum(any(d["shape"] for d in dets) for dets in detections) >= 6


def test_eval_job_writes_table_and_grid(tmp_path):
    config = runpy.run_path("configs/eval_shapes.py")["get_config"]()
    config.eval.update(max_prompts=12, batch_size=12, num_steps=8)
    table = main.run_job(config, str(tmp_path))
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert set(saved["table"]) == {"single_object", "overall"}  # the first 12 test prompts are single_object
    assert saved["table"] == table and (tmp_path / "eval_grid.png").exists()


def test_altered_or_missing_asset_files_are_named(tmp_path):
    folder = tmp_path / "shapes32"
    shutil.copytree(assets.ASSET_DIR + "/shapes32", folder)
    assets.verify(str(folder))
    (folder / "model.json").write_text((folder / "model.json").read_text() + " ")
    (folder / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(assets.AssetError, match=r"missing \['tokenizer/tokenizer.json'\], altered \['model.json'\]"):
        assets.verify(str(folder))
    (folder / "MANIFEST.json").unlink()
    with pytest.raises(assets.AssetError, match="MANIFEST.json is missing"):
        assets.verify(str(folder))


def test_unknown_checkpoint_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="shapes32"):
        assets.load_pipeline("no_such_model")


def test_learned_reward_tracks_the_exact_score_on_held_out_base_samples():
    reward, params, tokenizer, manifest = assets.load_reward("shapes32_reward")
    held = np.load(assets.ASSET_DIR + "/shapes32_reward/heldout.npz")
    images = held["images"].astype(np.float32) / 127.5 - 1.0
    prompts = [str(p) for p in held["prompts"]]
    exact = shapes_eval.evaluate(images, prompts)["score"]  # recomputed here, independently of training
    from flowrl_jax.models.text import tokenize

    ids, mask = tokenize(tokenizer, prompts, reward.max_len)
    predicted = np.asarray(jax.jit(reward.apply)({"params": params}, images, ids, mask))
    assert exact.std() > 0.1  # the held-out set spans good and bad samples
    assert pearson(predicted, exact) >= 0.8
    grad = jax.grad(lambda x: reward.apply({"params": params}, x, ids[:4], mask[:4]).sum())(jnp.asarray(images[:4]))
    assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad).max()) > 0  # differentiable w.r.t. pixels


def test_train_reward_smoke(tmp_path):
    config = runpy.run_path("configs/train_reward.py")["get_config"]("smoke")
    result = main.run_job(config, str(tmp_path))
    assert result["n_train"] == 64 + 16 and result["train_sources"]["generated"] == 16 and result["n_heldout"] == 16
    assert np.isfinite(result["mse_heldout"])
    assert json.loads((tmp_path / "reward_eval.json").read_text()) == result
