"""Where a Flow-GRPO iteration's time goes: a `jax.profiler` trace of compare_torch's setups, summed per compiled
program and per XLA op kind.

    python benchmarks/profile_step.py [--setup medium] [--set key=value ...] [--top 15]

Builds `compare_torch.py`'s setup (`quickstart`: the shipped shapes32 DiT; `medium`: width 512, depth 12, 256 tokens),
runs one iteration to compile, then traces `--iterations` more (rollout, exact reward, the updates). The trace's XLA
events (`hlo_module`, `hlo_op`) are summed per program (the rollout, the update, ...) and per op kind: the op's name
without its `.N` suffix (`loop_multiply_fusion`, `input_reduce_fusion`, `ynn_fusion`, `dot`, `wrapped_reduce-window`,
...), so a table says which kinds of XLA:CPU kernels take the time. Events run on several threads at once, so the
per-op sums can exceed the wall time; and XLA:CPU's dot events seem to end at dispatch (the medium update's idle gaps,
two thirds of its wall time, sit mostly after them), so matmuls are undercounted there. Writes benchmarks/results/profile_step_<setup>.json (`--out`); the raw trace
stays in `--trace_dir` for Perfetto (ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import compare_torch as ct  # noqa: E402
from flowrl_jax import config_lib  # noqa: E402


def op_kind(name: str) -> str:
    """'loop_multiply_fusion.12' -> 'loop_multiply_fusion'; 'dot.3' -> 'dot'."""
    return re.sub(r"(\.\d+)+$", "", name)


def summarize(trace_dir: str) -> dict:
    """{program: {"total_ms", "ops": {kind: ms}}} from the newest Perfetto trace under `trace_dir`."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    programs = collections.defaultdict(lambda: collections.Counter())
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and "hlo_module" in args:
            programs[args["hlo_module"]][op_kind(args["hlo_op"])] += e.get("dur", 0) / 1e3
    return {m: {"total_ms": sum(c.values()), "ops": dict(c.most_common())} for m, c in programs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", default="medium", choices=sorted(ct.SETUPS))
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. world.scan_blocks='\"always\"'")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--trace_dir", default="/tmp/flowrl_jax_profile")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pair, reward_fn = ct.setup_pair(args.setup, compile_modes=(), overrides=config_lib.parse_overrides(args.set))
    ct.time_jax_iteration(pair, reward_fn, 0)  # compiles
    jax.profiler.start_trace(args.trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    walls = [ct.time_jax_iteration(pair, reward_fn, it + 1) for it in range(args.iterations)]
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    programs = summarize(args.trace_dir)
    n = args.iterations
    print(f"{args.setup} {args.set}: {n} iteration(s) traced, {wall:.2f} s wall; rollout {walls[-1]['rollout_s']:.2f} s, "
          f"updates {walls[-1]['update_s']:.2f} s (last)")
    for module, prog in sorted(programs.items(), key=lambda kv: -kv[1]["total_ms"]):
        if prog["total_ms"] < 1:
            continue
        print(f"\n{module}: {prog['total_ms'] / n:.0f} ms of ops per iteration")
        for kind, ms in list(prog["ops"].items())[: args.top]:
            print(f"  {kind:48s} {ms / n:9.1f} ms {100 * ms / prog['total_ms']:5.1f}%")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"profile_step_{args.setup}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"setup": args.setup, "set": args.set, "iterations": n, "wall_s": wall, "iteration": walls,
                   "programs": programs}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
