"""Workdir paths: local folders and bucket URLs (flowrl_jax/paths.py). No bucket is reachable here: the URL cases
check what is decided without one (a URL stays as given, tensorstore gets it as its kvstore), the local ones run."""
import os

from flowrl_jax import paths


def test_urls_stay_as_given_and_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.resolve("gs://bucket/runs/a") == "gs://bucket/runs/a"
    assert paths.resolve("runs/a") == str(tmp_path / "runs" / "a")
    assert paths.kvstore_url("gs://bucket/ck/3/state") == "gs://bucket/ck/3/state/"
    assert paths.kvstore_url("ck/3/state/") == "file://" + str(tmp_path / "ck" / "3" / "state") + "/"
    assert os.path.join("gs://bucket/run", "metrics.jsonl") == "gs://bucket/run/metrics.jsonl"


def test_local_folders_files_and_appends(tmp_path):
    folder = str(tmp_path / "a" / "b")
    paths.makedirs(folder)
    paths.makedirs(folder)  # exists already: no error
    target = os.path.join(folder, "m.jsonl")
    paths.append_line(target, '{"step": 1}')
    paths.append_line(target, '{"step": 2}')
    with paths.open_file(target) as f:
        assert f.read() == '{"step": 1}\n{"step": 2}\n'
    paths.rename(folder, folder + ".damaged")
    assert paths.exists(folder + ".damaged") and not paths.exists(folder)
