"""The GPU path measured: the train job's rollout, decode and update of Flow-GRPO at SD3.5-Medium's real shapes
(random weights, 512 px, groups of 24, `configs/sd35m_*.py` with a memory plan) on this machine's accelerator:
images/s of the rollout and decode, (sample, step) pairs/s of the update, peak device memory against the compiled
plan; then the quickstart's iteration time on the same machine.

    python benchmarks/gpu_real_size.py                       # one GPU: plan "gpu", 2 prompts x 24 rows
    python benchmarks/gpu_real_size.py --tiny --quickstart_iterations 0   # toy shapes: checks the script anywhere

Rates come from the median of `--repeats` calls after a compiling one. The update's MFU is its hand-counted FLOPs
(`models/flops.py`: the policy's CFG-pair forward and backward and the KL reference's forward, as compare_torch.py
counts them) per second over the chip's bf16 peak (`--peak_tflops`, default from the device kind; 0: not computed).
`--attention cudnn` runs the DiT with cuDNN flash attention (`world.attention`). Peak memory is the device's
`peak_bytes_in_use` (XLA's allocator), the plan's figure is this backend's `memory_analysis` of the same compiled
functions (live weights and state + the stored rollout + the phase's temp). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_plan import GB, build_job, target_config  # noqa: E402

from flowrl_jax import metrics  # noqa: E402
from flowrl_jax.models import flops  # noqa: E402
from flowrl_jax.objectives.batch import IterationData  # noqa: E402
from flowrl_jax.rl.minibatch import minibatches  # noqa: E402
from flowrl_jax.rl.programs import schedule_of  # noqa: E402

# A toy pipeline of the same structure (tests/test_sd3.py's sizes): the script end to end on a CPU in a minute.
TINY_COMPONENTS = {
    "dit": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=24, pos_embed_max_size=8, qk_norm="rms_norm",
                dual_attention_layers=(0,)),
    "clip_l": dict(vocab_size=64, hidden_size=16, intermediate_size=24, projection_dim=12, num_hidden_layers=2, num_attention_heads=2,
                   max_position_embeddings=12, hidden_act="quick_gelu", eos_token_id=1),
    "clip_g": dict(vocab_size=64, hidden_size=8, intermediate_size=24, projection_dim=12, num_hidden_layers=2, num_attention_heads=2,
                   max_position_embeddings=12, hidden_act="gelu", eos_token_id=1),
    "t5": dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
               relative_attention_max_distance=16),
    "vae": dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                block_out_channels=(8, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4, scaling_factor=1.5305,
                shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
}
TINY_FIELDS = {"resolution": 16, "clip_max_length": 12, "t5_max_length": 10}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}  # dense, vendors' spec sheets


def update_flops(job) -> float:
    """Hand FLOPs of one update at the job's shapes (`flops.lora_update_flops`; latents are resolution / 8)."""
    w, side = job.config.world, job.config.world.resolution // 8
    return flops.lora_update_flops(job.model, job.frozen["dit"], job.pairs, side, side, w.clip_max_length + w.t5_max_length,
                                   job.state.params, job.config.objective.grpo.beta > 0)


def default_peak_tflops() -> float:
    kind = str(jax.devices()[0].device_kind)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), 0.0)


def _timed(fn, repeats: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn())  # compiled already: this call warms the allocator
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(args) -> dict:
    config, plan = target_config(args.plan, args.prompts)
    config.world.attention = args.attention
    if args.tiny:
        config.world.update(TINY_FIELDS)
        config.train.update(group_size=4, rollout_chunk=4, microbatch=4)
    devices = jax.devices()[: plan["devices"]]
    job = build_job(config, devices, TINY_COMPONENTS) if args.tiny else build_job(config, devices)
    t0 = time.perf_counter()
    compiled = {n: getattr(job, n).lower(*getattr(job, n + "_args")).compile() for n in ("rollout", "decode", "update")}
    compile_s = time.perf_counter() - t0
    frozen = job.init_frozen(jax.random.PRNGKey(0))
    state = job.init_state(frozen, jax.random.PRNGKey(1))
    ids = jax.device_put(np.zeros(job.rollout_args[2].shape, np.int32), job.rollout_args[2].sharding)
    mask = jax.device_put(np.ones(job.rollout_args[3].shape, bool), job.rollout_args[3].sharding)
    key = jax.random.PRNGKey(2)

    levels = job.rollout_args[5]
    rollout_s, (ro, cond, null) = _timed(lambda: compiled["rollout"](state.params, frozen, ids, mask, key, levels), args.repeats)
    decode_s, _ = _timed(lambda: compiled["decode"](frozen["vae"], ro.final), args.repeats)
    adv = jax.device_put(np.random.default_rng(0).standard_normal(job.data.adv.shape).astype(np.float32), job.data.adv.sharding)
    data = IterationData(ro, schedule_of(job.config.sampler, levels), adv, cond, null, key)
    rows, slots, weight = next(minibatches(np.ones(job.batch, bool), job.slots, job.pairs, np.random.default_rng(0)))
    holder = {"state": state}

    def one_update():  # the update donates its state: carry it from call to call
        holder["state"], stats = compiled["update"](holder["state"], frozen, data, rows, slots, weight)
        return stats

    update_s, _ = _timed(one_update, args.repeats)
    planned = {n: c.memory_analysis() for n, c in compiled.items()}
    peak_tflops = default_peak_tflops() if args.peak_tflops is None else args.peak_tflops
    upd_flops = update_flops(job)
    return {"device": str(jax.devices()[0].device_kind), "devices": len(devices), "plan": args.plan, "tiny": args.tiny,
            "rows": job.batch, "pairs_per_update": job.pairs, "compile_s": compile_s,
            "rollout_s": rollout_s, "rollout_images_per_s": job.batch / rollout_s,
            "decode_s": decode_s, "decode_images_per_s": job.batch / decode_s,
            "update_s": update_s, "update_pairs_per_s": job.pairs / update_s, "attention": args.attention,
            "update_tflops": upd_flops / 1e12, "update_tflop_s": upd_flops / update_s / 1e12, "peak_tflops": peak_tflops,
            "update_mfu": upd_flops / update_s / 1e12 / peak_tflops if peak_tflops else None,
            "peak_bytes_in_use": _peak_bytes(),
            "planned_temp_bytes": {n: m.temp_size_in_bytes for n, m in planned.items()},
            "weights_and_state_bytes": job.sizes["frozen"] + job.sizes["state"]}


def quickstart_iteration_s(iterations: int) -> dict:
    """The quickstart (configs/quickstart.py) for `iterations` on this machine: seconds per iteration after the first."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "flowrl_jax.main", "--config", "configs/quickstart.py", "--workdir", workdir,
               f"--config.train.iterations={iterations}", "--config.eval.at_start=False", "--config.checkpoint.every=0"]
        subprocess.run(cmd, check=True)
        rows = [r for r in metrics.read_metrics(workdir) if "rollout_s" in r][1:]
    per = [r["rollout_s"] + r["reward_s"] + r["update_s"] for r in rows]
    return {"iterations_timed": len(per), "iteration_s": statistics.median(per) if per else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="gpu", help="common.MEMORY_PLANS entry (its device count is used)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per iteration (x 24 rows)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="toy components and shapes (a check of the script)")
    parser.add_argument("--attention", default="xla", help="world.attention: xla, cudnn (GPU), splash (TPU)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the chip's bf16 peak (default: by device kind)")
    parser.add_argument("--quickstart_iterations", type=int, default=6, help="0: skip the quickstart timing")
    parser.add_argument("--out", default="benchmarks/results/gpu_real_size.json")
    args = parser.parse_args()
    result = measure(args)
    if args.quickstart_iterations:
        result["quickstart"] = quickstart_iteration_s(args.quickstart_iterations)
    peak = result["peak_bytes_in_use"]
    print(f"{result['device']} x {result['devices']}, plan {args.plan}{' (tiny)' if args.tiny else ''}: {result['rows']} rows, "
          f"{result['pairs_per_update']} pairs per update; compile {result['compile_s']:.0f} s")
    print(f"{'phase':8s} {'s':>8s} {'per s':>12s}")
    print(f"{'rollout':8s} {result['rollout_s']:8.2f} {result['rollout_images_per_s']:8.2f} img")
    print(f"{'decode':8s} {result['decode_s']:8.2f} {result['decode_images_per_s']:8.2f} img")
    print(f"{'update':8s} {result['update_s']:8.2f} {result['update_pairs_per_s']:8.2f} pairs, {result['update_tflop_s']:.1f} TFLOP/s"
          + (f", MFU {100 * result['update_mfu']:.1f}% of {result['peak_tflops']:.0f}" if result["update_mfu"] else ""))
    print(f"peak memory {peak / GB if peak else float('nan'):.1f} GB; weights + state {result['weights_and_state_bytes'] / GB:.1f} GB; "
          "planned temp " + ", ".join(f"{n} {b / GB:.1f}" for n, b in result["planned_temp_bytes"].items()) + " GB")
    if "quickstart" in result:
        print(f"quickstart: {result['quickstart']['iteration_s']} s per iteration")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
