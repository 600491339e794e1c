"""Metrics out: JSONL + TensorBoard scalars, and PNG image grids.

    writer = MetricWriter(workdir)           # workdir/metrics.jsonl and TensorBoard events in workdir/tb
    writer.scalars(step, {"loss": 0.1})
    save_grid(images [N, H, W, 3] in [-1, 1], "samples.png", rows=4, labels=[...])

Process 0 writes them, often to a bucket: each write is tried `WRITE_TRIES` times (`best_effort`), then dropped with a
warning, so a transient 5xx costs a metrics row or a PNG, never the run.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw

from flowrl_jax import paths


def is_writer() -> bool:
    """Whether this process writes the run's files (metrics, images, reports): process 0 of a multi-process run."""
    import jax

    return jax.process_index() == 0


WRITE_TRIES = 3     # a bucket's transient errors (5xx, a reset connection) clear within seconds
WRITE_BACKOFF_S = 1.0  # waits 1 s, then 4 s: at most ~5 s of an iteration lost to a failing bucket per write


def best_effort(what: str, write: Callable[[], None], tries: int = WRITE_TRIES, backoff_s: float = WRITE_BACKOFF_S) -> bool:
    """Run `write`, retried after backoff_s * 4^k; after `tries` failures print one warning naming `what` and the error,
    and go on. -> whether it was written. For the run's outputs that a later write replaces or extends (metrics rows,
    PNGs), not for checkpoints."""
    for attempt in range(tries):
        try:
            write()
            return True
        except Exception as e:  # noqa: BLE001 - any failure of a store (OSError, a client library's own errors)
            if attempt + 1 == tries:
                error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(f"flowrl_jax: warning: {what} failed {tries} times ({type(e).__name__}: {error}); the run goes on "
                      "without it", file=sys.stderr, flush=True)
                return False
            time.sleep(backoff_s * 4**attempt)
    return False


class MetricWriter:
    """Appends `{"step", "time", **scalars}` lines to metrics.jsonl and mirrors them to TensorBoard (process 0 only)."""

    def __init__(self, workdir: str):
        from tensorboardX import SummaryWriter

        self.path, self.tb = os.path.join(workdir, "metrics.jsonl"), None
        if is_writer():
            paths.makedirs(workdir)
            self.tb = SummaryWriter(os.path.join(workdir, "tb"))  # tensorboardX writes gs:// through google-cloud-storage

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if self.tb is None:
            return
        values = {k: float(v) for k, v in values.items()}
        row = json.dumps({"step": int(step), "time": time.time(), **values})
        best_effort(f"the metrics row of step {step} ({self.path})", lambda: paths.append_line(self.path, row))
        for k, v in values.items():  # queued in memory; the flush writes them (retried alone: no scalar twice)
            self.tb.add_scalar(k, v, int(step))
        best_effort(f"the TensorBoard events of step {step}", self.tb.flush)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not paths.exists(path):
        return []
    with paths.open_file(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def to_uint8(images) -> np.ndarray:
    """[-1, 1] float -> uint8 [0, 255]."""
    return np.clip((np.asarray(images, np.float32) + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)


def save_grid(images, path: str, rows: int | None = None, labels: Sequence[str] | None = None, scale: int = 3,
              row_titles: Sequence[str] | None = None) -> str:
    """Tile images [N, H, W, 3] in [-1, 1] into a PNG (upscaled `scale`x, nearest); optional
    per-image captions below each cell and a title at the start of each row. Process 0 writes; the others return."""
    if not is_writer():
        return path
    images = to_uint8(images)
    n, h, w, _ = images.shape
    rows = rows or int(math.ceil(math.sqrt(n)))
    cols = int(math.ceil(n / rows))
    cell_h, cell_w = h * scale + (12 if labels else 0), w * scale
    left = 90 if row_titles else 0
    canvas = Image.new("RGB", (left + cols * (cell_w + 2), rows * (cell_h + 2)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        r, c = divmod(i, cols)
        x0, y0 = left + c * (cell_w + 2), r * (cell_h + 2)
        canvas.paste(Image.fromarray(images[i]).resize((cell_w, h * scale), Image.NEAREST), (x0, y0))
        if labels:
            draw.text((x0 + 1, y0 + h * scale), str(labels[i])[: cell_w // 6], fill=(0, 0, 0))
    for r, title in enumerate(row_titles or []):
        draw.text((2, r * (cell_h + 2) + cell_h // 2 - 5), str(title)[:14], fill=(0, 0, 0))

    def write():
        paths.makedirs(os.path.dirname(paths.resolve(path)))
        with paths.open_file(path, "wb") as f:
            canvas.save(f, format="PNG")
    best_effort(f"the image grid {path}", write)
    return path


def plot_report(workdir: str, path: str, eval_curves: dict[str, str]) -> dict[str, int]:
    """report.png: the training reward and the eval's `eval_curves` ({metrics key: label}, the world's) against the
    step (left) and the training wall-clock (right), from workdir/metrics.jsonl. Process 0 writes.
    -> {label: points} of each curve drawn (empty on other processes)."""
    if not is_writer():
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    train = [r for r in rows if "reward" in r]
    curves = {"train reward (mean)": ("reward", train, {"lw": 1, "alpha": 0.6})} if train else {}
    for key, name in eval_curves.items():
        points = [r for r in rows if key in r]
        if points:
            curves[name] = (key, points, {"marker": "o"})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x_key, label in ((axes[0], "step", "step"), (axes[1], "wall_s", "training wall-clock (s)")):
        for name, (key, points, style) in curves.items():
            ax.plot([r.get(x_key, 0.0) for r in points], [r[key] for r in points], label=name, **style)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(os.path.basename(paths.resolve(workdir).rstrip("/")))
    fig.tight_layout()
    with paths.open_file(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return {name: len(points) for name, (_, points, _) in curves.items()}
