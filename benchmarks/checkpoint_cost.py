"""What a checkpoint of the SD3.5-Medium LoRA train state costs the loop: the time `Checkpointer.save` blocks (orbax's
asynchronous save: the copy to host memory and the write's start) and the time until the write is done, on this
machine's local disk. The pod presets save after every iteration when the blocking part is under 2% of the shortest
iteration on paper (`benchmarks/goodput_on_paper.py` reads this file).

    python benchmarks/checkpoint_cost.py [--repeats 5] [--out benchmarks/results/checkpoint_cost.json]

The state is `configs/sd35m_pickscore.py`'s (LoRA rank 32 on the MMDiT's attention, with its EMA, its old policy and
Adam's moments), built from abstract shapes (no weights) as zeros in host memory, one CPU device. On a TPU the blocking
part is the device-to-host copy of each host's shards (PCIe/DMA at tens of GB/s) plus the same orbax bookkeeping
measured here; the write goes to a bucket in the background, which must finish before the next save starts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from configs import common
from flowrl_jax.checkpoint import Checkpointer
from machine import describe  # noqa: E402  (benchmarks/)
from memory_plan import _bytes, build_job, target_config  # noqa: E402


def lora_state():
    """The pod preset's TrainState (LoRA), as zeros on this process's first device."""
    config, _ = target_config("gpu", common.sd35m_train_config().train.prompts_per_iteration)
    abstract = build_job(config, jax.devices()[:1]).state
    return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), _bytes(abstract)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/checkpoint_cost.json")
    args = parser.parse_args()
    state, size = lora_state()
    folder = tempfile.mkdtemp(prefix="checkpoint_cost_")
    blocking, total = [], []
    try:
        with Checkpointer(folder, max_to_keep=2) as ckpt:
            for step in range(args.repeats + 1):  # the first save is a warm-up (thread pools, the folder's creation)
                t0 = time.perf_counter()
                ckpt.save(step, state, {"step": step})
                t1 = time.perf_counter()
                ckpt.manager.wait_until_finished()
                t2 = time.perf_counter()
                if step:
                    blocking.append(t1 - t0)
                    total.append(t2 - t0)
                print(f"save {step}: blocks {t1 - t0:.3f} s, written after {t2 - t0:.3f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"what": "Checkpointer.save of the SD3.5-M LoRA train state (configs/sd35m_pickscore.py), local disk",
              "state_bytes": size, "repeats": args.repeats, "blocking_s": statistics.median(blocking),
              "written_s": statistics.median(total), "blocking_all_s": blocking, "written_all_s": total,
              "env": describe(jax=jax.__version__)}
    print(f"state {size / 1e9:.2f} GB: save blocks the loop {result['blocking_s']:.3f} s (median of {args.repeats}), "
          f"written after {result['written_s']:.3f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
