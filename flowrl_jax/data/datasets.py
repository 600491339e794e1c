"""Prompt datasets as ArrayRecord files, written once and read per process with grain.

    n = convert("flow_grpo/dataset/geneval/train_metadata.jsonl", "data/geneval", "train")
    ds = PromptDataset("data/geneval", "train")        # random access: len(ds), ds[i] -> row dict
    reader = PromptReader(ds, batch_size=8, seed=0,
                          process_index=jax.process_index(), process_count=jax.process_count())
    rows = next(reader)                                # this process's next 8 rows
    state = reader.get_state()                         # JSON-able; reader.set_state(state) resumes exactly

    python -m flowrl_jax.data.datasets SOURCE OUT_DIR --split train [--format auto|jsonl|text]

A row is a dict with at least "prompt"; a record is its JSON bytes. Sources: JSONL, one object per line
(flow_grpo's GenEval `*_metadata.jsonl`, kept whole since rewards read "tag"/"include"; the shapes world's
{"prompt", "category", "spec"} files), or text, one prompt per line (flow_grpo's ocr/pickscore `*.txt`).
`convert` writes `OUT_DIR/<split>.array_record` and records count, format and source per split in
`OUT_DIR/info.json`. It writes with array_record's ArrayRecordWriter directly: tfds 4.9.10 can write
array_record without TensorFlow, but it wraps each record in a tf.Example, reorders records and imposes its
own file layout. Reading needs only array_record and grain.

`PromptReader` deals one global stream of shuffled epochs (a new permutation per epoch, fixed by the seed)
round-robin over processes: stream row t goes to process t % process_count. So every epoch of the stream is
split disjointly over the processes and covered exactly once, whatever the sizes. With n rows, P processes
and batch size B: if P divides n each process gets n / P rows of every epoch; if P * B divides n every batch
lies within one epoch; otherwise a batch may straddle two epochs and then may hold a prompt twice.
"""
from __future__ import annotations

import argparse
import json
import operator
import os

import grain
from array_record.python.array_record_module import ArrayRecordWriter

FORMATS = ("jsonl", "text")
_EXTENSIONS = {".jsonl": "jsonl", ".txt": "text"}  # for format="auto"
_EXAMPLE = '{"prompt": "a photo of a cat"}'


def _format_of(path: str, format: str) -> str:
    if format == "auto":
        ext = os.path.splitext(path)[1].lower()
        if ext not in _EXTENSIONS:
            raise ValueError(f"cannot tell the format of {path} from its extension; pass format='jsonl' or 'text'")
        return _EXTENSIONS[ext]
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected 'auto' or one of {FORMATS}")
    return format


def read_source(path: str, format: str = "auto") -> list[dict]:
    """Read a JSONL or text prompt file -> list of row dicts, each with a str "prompt"."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt source {path} not found")
    format = _format_of(path, format)
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if format == "text":
                rows.append({"prompt": line.strip()})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not JSON ({e.msg}); each line must be one JSON object "
                                 f"such as {_EXAMPLE} (or pass format='text' for one prompt per line)") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{path} line {number} has no string "prompt" field; each line must be one JSON '
                                 f"object such as {_EXAMPLE}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} is empty: it needs at least one prompt line")
    return rows


def convert(source_path: str, out_dir: str, split: str, format: str = "auto") -> int:
    """Write `source_path`'s rows to `out_dir/<split>.array_record` and note them in `out_dir/info.json`;
    returns the number of records."""
    rows = read_source(source_path, format)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{split}.array_record")
    writer = ArrayRecordWriter(path + ".tmp", "group_size:1")  # group size 1: cheap random access
    for row in rows:
        writer.write(json.dumps(row).encode())
    writer.close()
    os.replace(path + ".tmp", path)
    info_path = os.path.join(out_dir, "info.json")
    info = {"splits": {}}
    if os.path.isfile(info_path):
        with open(info_path) as f:
            info = json.load(f)
    info["splits"][split] = {"count": len(rows), "format": _format_of(source_path, format),
                             "source": os.path.abspath(source_path)}
    with open(info_path, "w") as f:
        json.dump(info, f, indent=1)
    return len(rows)


class PromptDataset:
    """Random access to rows: `len(ds)`, `ds[i] -> dict` (a fresh dict each call).

    `path_or_rows` is a directory written by `convert` (with `split`), an `.array_record` file, or a list
    of row dicts (kept as JSON records, so in-memory sets read back exactly like converted ones)."""

    def __init__(self, path_or_rows, split: str | None = None):
        if isinstance(path_or_rows, (list, tuple)):
            if not path_or_rows or not all(isinstance(r, dict) and "prompt" in r for r in path_or_rows):
                raise ValueError('PromptDataset needs a non-empty list of dicts, each with a "prompt"')
            self._records = [json.dumps(r).encode() for r in path_or_rows]
            return
        path = str(path_or_rows)
        if not path.endswith(".array_record"):
            if split is None:
                raise ValueError(f"PromptDataset({path!r}) is a directory: pass the split too")
            path = os.path.join(path, f"{split}.array_record")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt dataset {path} not found; write it with "
                                    "`python -m flowrl_jax.data.datasets SOURCE OUT_DIR --split SPLIT`")
        self._records = grain.sources.ArrayRecordDataSource(path)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict:
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        return json.loads(self._records[index % len(self)])


class PromptReader:
    """Endless iterator of this process's batches: lists of `batch_size` rows (see the module docstring).

    Built as grain.MapDataset.source(ds).seed(seed).shuffle().repeat()[process_index::process_count]
    .batch(batch_size), iterated in this thread; `get_state`/`set_state` checkpoint it."""

    def __init__(self, source, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1):
        source = source if isinstance(source, PromptDataset) else PromptDataset(source)
        if batch_size < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"need batch_size >= 1 and 0 <= process_index < process_count, got {batch_size=}, "
                             f"{process_index=}, {process_count=}")
        self._config = {"seed": seed, "batch_size": batch_size, "process_index": process_index,
                        "process_count": process_count, "num_rows": len(source)}
        ds = grain.MapDataset.source(source).seed(seed).shuffle().repeat()
        ds = ds[process_index::process_count].batch(batch_size, batch_fn=list)
        self._iterator = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-able position (with the reader's settings, checked on restore)."""
        return {**self._config, **self._iterator.get_state()}

    def set_state(self, state: dict) -> None:
        """Continue from `state` (from `get_state` of a reader with the same settings)."""
        config = {k: state.get(k) for k in self._config}
        if config != self._config:
            raise ValueError(f"reader state was saved with {config}, this reader has {self._config}")
        self._iterator.set_state({k: v for k, v in state.items() if k not in self._config})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Convert a JSONL or text prompt file to an ArrayRecord split.")
    parser.add_argument("source", help="JSONL (one object with a \"prompt\" per line) or text (one prompt per line)")
    parser.add_argument("out_dir")
    parser.add_argument("--split", default="train")
    parser.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    args = parser.parse_args(argv)
    count = convert(args.source, args.out_dir, args.split, args.format)
    print(f"wrote {count} records to {os.path.join(args.out_dir, args.split + '.array_record')}")


if __name__ == "__main__":
    main()
