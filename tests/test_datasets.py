"""Prompt datasets: conversion to ArrayRecord, random access, and the per-process grain reader."""
import json
import os

import pytest

from flowrl_jax.data import datasets, shapes
from flowrl_jax.worlds import shapes as world_shapes

GENEVAL = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
     "prompt": "a photo of two dogs"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
]


def _write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def _rows(n):
    return [{"prompt": f"p{i}", "index": i} for i in range(n)]


def _take(reader, steps):
    return [[row["index"] for row in next(reader)] for _ in range(steps)]


def test_geneval_jsonl_round_trip(tmp_path):
    src = _write(tmp_path / "train_metadata.jsonl", json.dumps(GENEVAL[0]) + "\n\n" +
                 "".join(json.dumps(r) + "\n" for r in GENEVAL[1:]))
    assert datasets.convert(src, tmp_path / "out", "train") == 3
    ds = datasets.PromptDataset(tmp_path / "out", "train")
    assert len(ds) == 3 and [ds[i] for i in range(3)] == GENEVAL and ds[-1] == GENEVAL[-1]
    assert list(datasets.PromptDataset(str(tmp_path / "out" / "train.array_record"))) == GENEVAL
    with pytest.raises(IndexError):
        ds[3]
    info = json.load(open(tmp_path / "out" / "info.json"))
    assert info["splits"]["train"] == {"count": 3, "format": "jsonl", "source": os.path.abspath(src)}


def test_text_round_trip_and_info_keeps_splits(tmp_path):
    train = _write(tmp_path / "train.txt", "a cat on a mat\n\n  a sign that says 'hello'  \n")
    test = _write(tmp_path / "test.txt", "one prompt\n")
    assert datasets.convert(train, tmp_path / "ocr", "train") == 2
    assert datasets.main([test, str(tmp_path / "ocr"), "--split", "test"]) is None
    assert list(datasets.PromptDataset(tmp_path / "ocr", "train")) == [
        {"prompt": "a cat on a mat"}, {"prompt": "a sign that says 'hello'"}]
    assert list(datasets.PromptDataset(tmp_path / "ocr", "test")) == [{"prompt": "one prompt"}]
    info = json.load(open(tmp_path / "ocr" / "info.json"))["splits"]
    assert (info["train"]["count"], info["test"]["count"], info["test"]["format"]) == (2, 1, "text")


@pytest.mark.parametrize("split", ["train", "test"])
def test_shipped_shapes_sets(tmp_path, split):
    expected = shapes.load_prompts(split)
    n = datasets.convert(os.path.join(shapes.PROMPT_DIR, f"{split}.jsonl"), tmp_path, split)
    assert n == len(expected)
    assert list(datasets.PromptDataset(tmp_path, split)) == expected
    assert list(datasets.PromptDataset(expected)) == expected
    assert world_shapes.load_prompt_set(str(tmp_path), split) == expected  # the shapes world reads the dataset too


def test_shapes_world_refuses_rows_without_its_fields(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n")
    datasets.convert(str(tmp_path / "p.txt"), tmp_path / "d", "train")
    with pytest.raises(ValueError, match=r"rows without \['category', 'spec'\]"):
        world_shapes.load_prompt_set(str(tmp_path / "d"), "train")


def test_reader_is_deterministic_per_seed(tmp_path):
    rows = _rows(10)
    a, b = (datasets.PromptReader(rows, 3, seed=7) for _ in range(2))
    assert _take(a, 8) == _take(b, 8)
    assert _take(datasets.PromptReader(rows, 3, seed=7), 8) != _take(datasets.PromptReader(rows, 3, seed=8), 8)
    _write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    datasets.convert(str(tmp_path / "p.jsonl"), tmp_path, "train")  # the ArrayRecord source reads the same
    assert _take(datasets.PromptReader(datasets.PromptDataset(tmp_path, "train"), 3, seed=7), 8) == \
        _take(datasets.PromptReader(rows, 3, seed=7), 8)


def test_epochs_are_fresh_permutations():
    batches = _take(datasets.PromptReader(_rows(10), 5, seed=0), 8)
    epochs = [batches[i] + batches[i + 1] for i in range(0, 8, 2)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4


def test_two_processes_split_each_epoch():
    readers = [datasets.PromptReader(_rows(12), 3, seed=1, process_index=p, process_count=2) for p in range(2)]
    per_process = [_take(r, 6) for r in readers]  # 12 rows / (2 processes * 3) = 2 steps per epoch
    for epoch in range(3):
        mine = [sum(per_process[p][2 * epoch:2 * epoch + 2], []) for p in range(2)]
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == list(range(12))


def test_uneven_sizes_deal_one_stream_round_robin():
    n, count, size, steps = 7, 2, 2, 14
    batches = [_take(datasets.PromptReader(_rows(n), size, seed=3, process_index=p, process_count=count), steps)
               for p in range(count)]
    stream = [None] * (count * size * steps)  # stream row t went to process t % count
    for p in range(count):
        for k, batch in enumerate(batches[p]):
            for j, index in enumerate(batch):
                stream[p + count * (k * size + j)] = index
    assert all(sorted(stream[e * n:(e + 1) * n]) == list(range(n)) for e in range(len(stream) // n))


def test_state_restores_exactly():
    rows = _rows(9)
    reader = datasets.PromptReader(rows, 4, seed=5, process_index=1, process_count=2)
    _take(reader, 3)
    state = json.loads(json.dumps(reader.get_state()))
    expected = _take(reader, 6)
    restored = datasets.PromptReader(rows, 4, seed=5, process_index=1, process_count=2)
    restored.set_state(state)
    assert _take(restored, 6) == expected
    assert _take(datasets.PromptReader(rows, 4, seed=5, process_index=1, process_count=2), 3) != expected[:3]
    with pytest.raises(ValueError, match="seed"):
        datasets.PromptReader(rows, 4, seed=6, process_index=1, process_count=2).set_state(state)


def test_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        datasets.convert(missing, tmp_path / "out", "train")
    empty = _write(tmp_path / "empty.txt", "\n  \n")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        datasets.convert(empty, tmp_path / "out", "train")
    bad = _write(tmp_path / "bad.jsonl", '{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2 is not JSON.*format='text'"):
        datasets.convert(bad, tmp_path / "out", "train")
    no_prompt = _write(tmp_path / "np.jsonl", '{"tag": "colors"}\n')
    with pytest.raises(ValueError, match='np.jsonl line 1 has no string "prompt"'):
        datasets.convert(no_prompt, tmp_path / "out", "train")
    odd = _write(tmp_path / "prompts.csv", "a cat\n")
    with pytest.raises(ValueError, match="format='jsonl' or 'text'"):
        datasets.convert(odd, tmp_path / "out", "train")
    assert not os.path.exists(tmp_path / "out")  # failed conversions write nothing
    assert datasets.convert(odd, tmp_path / "out", "train", format="text") == 1
    with pytest.raises(FileNotFoundError, match="test.array_record"):
        datasets.PromptDataset(tmp_path / "out", "test")
    with pytest.raises(ValueError, match="prompt"):
        datasets.PromptDataset([{"text": "no prompt"}])
    with pytest.raises(ValueError, match="process_index"):
        datasets.PromptReader(_rows(4), 2, seed=0, process_index=2, process_count=2)
