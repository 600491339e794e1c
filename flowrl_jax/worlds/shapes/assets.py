"""Shipped models, loadable by name: `flowrl_jax/assets/<name>/` (`shapes32`: the base DiT and text
encoder; `shapes32_reward`: the learned reward, loaded by `worlds/shapes/learned.load`).

    pipe, params, info = load_pipeline("shapes32")           # a shipped asset, manifest-checked
    pipe, params, info = load_pipeline("workdirs/pretrain")  # or any pretrain workdir (latest checkpoint)
    export(workdir, name); write_manifest(folder, fields)    # what the export job (`export.py`) calls

An asset folder holds `model.json` (DiT + text-encoder hyper-parameters), `tokenizer/`
(`save_pretrained`), `params/` (orbax, the EMA weights) and `MANIFEST.json`: the training config and
steps, the measured test scores, and the sha256 of every file. Loading recomputes the hashes and
names every missing or altered file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict
from transformers import PreTrainedTokenizerFast

from flowrl_jax import checkpoint
from flowrl_jax.worlds.shapes.pipeline import build_pipeline

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")  # flowrl_jax/assets/


class AssetError(RuntimeError):
    """A shipped asset is missing, incomplete or altered."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, names in os.walk(folder) for f in names
                  if f != "MANIFEST.json")


def verify(folder: str) -> dict:
    """Check every file listed in MANIFEST.json against its sha256; returns the manifest."""
    manifest_path = os.path.join(folder, "MANIFEST.json")
    if not os.path.isfile(manifest_path):
        raise AssetError(f"{manifest_path} is missing: the asset folder is incomplete (reinstall flowrl_jax or re-export it)")
    with open(manifest_path) as f:
        manifest = json.load(f)
    missing = [name for name in manifest["files"] if not os.path.isfile(os.path.join(folder, name))]
    altered = [name for name, digest in manifest["files"].items() if name not in missing and _sha256(os.path.join(folder, name)) != digest]
    if missing or altered:
        raise AssetError(f"asset {folder} does not match its MANIFEST.json: missing {missing}, altered {altered}; "
                         "restore the files from git (git checkout -- flowrl_jax/assets) or re-export the asset")
    return manifest


def _build(folder: str):
    with open(os.path.join(folder, "model.json")) as f:
        desc = json.load(f)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
    return build_pipeline(ConfigDict(desc), tokenizer)


def load_pipeline(name_or_path: str, use_ema: bool = True):
    """-> (Pipeline, params {"dit", "text"}, info) from a shipped asset name or a pretrain workdir."""
    asset = os.path.join(ASSET_DIR, name_or_path)
    if os.sep not in name_or_path and os.path.isdir(asset):  # a bare name is a shipped asset
        manifest = verify(asset)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), checkpoint.load_params(os.path.join(asset, "params")))
        return _build(asset), params, {"name": name_or_path, "path": asset, "manifest": manifest}
    ckpt_dir = os.path.join(name_or_path, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        shipped = sorted(os.listdir(ASSET_DIR)) if os.path.isdir(ASSET_DIR) else []
        raise FileNotFoundError(f"{name_or_path!r} is neither a shipped asset ({shipped}) nor a workdir with checkpoints/")
    with checkpoint.Checkpointer(ckpt_dir) as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir}: train first, or point to a shipped asset")
        state, meta = ckpt.restore(step, None)
    return _build(name_or_path), state["ema" if use_ema else "params"], {"name": name_or_path, "path": name_or_path, "step": step}


def export(workdir: str, name: str) -> tuple[str, int]:
    """Write `flowrl_jax/assets/<name>/` from a pretrain workdir's latest checkpoint: the EMA weights
    stored as bfloat16 (half the bytes; loaded back as float32). Returns (folder, step); the caller
    measures the asset as loaded and writes its MANIFEST.json."""
    _, params, info = load_pipeline(workdir, use_ema=True)
    folder = os.path.join(ASSET_DIR, name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    shutil.copy(os.path.join(workdir, "model.json"), folder)
    shutil.copytree(os.path.join(workdir, "tokenizer"), os.path.join(folder, "tokenizer"))
    checkpoint.save_params(os.path.join(folder, "params"), jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), params))
    return folder, info["step"]


def write_manifest(folder: str, fields: dict) -> dict:
    """MANIFEST.json = `fields` + the sha256 of every other file in `folder`."""
    manifest = {**fields, "files": {f: _sha256(os.path.join(folder, f)) for f in _files(folder)}}
    with open(os.path.join(folder, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest
