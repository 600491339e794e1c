"""The `inspect` job: build the configured MMDiT sharded on the mesh, report its parameters and
their shardings, and time one jit-compiled forward pass on random inputs.

A researcher's first check on a new pod slice or a new checkpoint: does it fit, how is it
sharded, does it run. Writes `inspect.json` to the workdir when one is given.
"""
from __future__ import annotations

import json
import os
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax import metrics, parallel
from flowrl_jax.models import create_params


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


def summarize(params) -> dict:
    """Parameter count per top-level module, and the specs of the ten largest arrays."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    per_module: dict[str, int] = {}
    for path, x in flat.items():
        top = path.split("/")[0]
        per_module[top] = per_module.get(top, 0) + x.size
    largest = sorted(flat.items(), key=lambda kv: -kv[1].size)[:10]
    shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in flat.values())
    return {
        "total_params": int(sum(per_module.values())),
        "per_module": per_module,
        "largest": [{"path": p, "shape": list(x.shape), "spec": str(x.sharding.spec)} for p, x in largest],
        "param_bytes_on_device_0": int(shard_bytes),
    }


def run(config, workdir: str | None) -> dict:
    parallel.maybe_initialize_distributed(config.distributed)
    mesh = parallel.make_mesh(config.mesh)
    rng = jax.random.PRNGKey(config.seed)
    t0 = time.perf_counter()
    model, params, shardings = create_params(config.model, mesh, config.partition_rules, config.min_fsdp_size, rng)
    init_s = time.perf_counter() - t0

    b, length = config.inspect.batch_size, config.inspect.text_len
    keys = jax.random.split(jax.random.fold_in(rng, 1), 4)
    x, _, txt, pooled = model.dummy_inputs(b, length)
    inputs = (jax.random.normal(keys[0], x.shape), jax.random.uniform(keys[1], (b,)),
              jax.random.normal(keys[2], txt.shape), jax.random.normal(keys[3], pooled.shape))
    data = parallel.batch_sharding(mesh)
    inputs = parallel.shard_batch(jax.tree_util.tree_map(lambda a: np.asarray(a)[parallel.process_batch_slice(b)], inputs), mesh)
    forward = jax.jit(lambda p, *a: model.apply({"params": p}, *a), in_shardings=(shardings, data, data, data, data), out_shardings=data)
    t0 = time.perf_counter()
    compiled = forward.lower(params, *inputs).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(params, *inputs))
    t0 = time.perf_counter()
    v = jax.block_until_ready(compiled(params, *inputs))
    forward_s = time.perf_counter() - t0

    v = parallel.to_host(v)  # every process's rows
    report = summarize(params)
    report.update(mesh=dict(mesh.shape), devices=jax.device_count(), platform=jax.devices()[0].platform,
                  init_s=init_s, compile_s=compile_s, forward_s=forward_s, batch_size=b,
                  output_shape=list(v.shape), output_std=float(jnp.std(v)), output_finite=bool(np.isfinite(np.asarray(v)).all()))

    if not metrics.is_writer():  # process 0 reports
        return report
    print(f"MMDiT {_human(report['total_params'])} params on mesh {report['mesh']} ({report['platform']}, {report['devices']} devices)")
    for name, n in report["per_module"].items():
        if not name.startswith("transformer_blocks_") or name in ("transformer_blocks_0", f"transformer_blocks_{model.num_layers - 1}"):
            print(f"  {name:28s} {_human(n):>8s}")
    print("  largest arrays and their PartitionSpecs:")
    for row in report["largest"][:5]:
        print(f"    {row['path']:48s} {str(tuple(row['shape'])):18s} {row['spec']}")
    print(f"  params on device 0: {report['param_bytes_on_device_0'] / 2**20:.1f} MiB")
    print(f"  init {init_s:.2f}s  compile {compile_s:.2f}s  forward(batch {b}) {forward_s * 1e3:.1f} ms  "
          f"out {tuple(v.shape)} std {report['output_std']:.3f} finite={report['output_finite']}")
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "inspect.json"), "w") as f:
            json.dump(report, f, indent=2)
    return report
