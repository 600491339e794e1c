"""Mesh, parameter partition rules and batch sharding: sharding as data, the compiler does the rest.

    mesh = make_mesh([("data", -1), ("fsdp", 1)])              # -1 takes the remaining devices
    params, shardings = init_sharded(init_fn, rng, mesh, DEFAULT_RULES)
    batch = shard_batch(batch, mesh)                           # leading axis over (data, fsdp)
    step = jax.jit(step_fn, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=...)

Partition rules are `(regex, spec)` pairs matched in order against a parameter's path
('transformer_blocks_3/ff/fc1/kernel'); the first match wins. A spec is
  - "fsdp": shard the largest dimension divisible by the fsdp axis size over `fsdp`, if the array
    has at least `min_fsdp_size` elements (ZeRO-3 style); otherwise replicate;
  - "replicate": a full copy on every device;
  - a tuple of mesh-axis names / None, one per dimension: an explicit `PartitionSpec`.
The mesh uses `AxisType.Auto` axes: shardings are annotations at the jit boundary and XLA
propagates them (FSDP all-gathers, gradient reduce-scatters), no per-op sharding in the model.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

DEFAULT_RULES = (
    (r"kernel$", "fsdp"),
    (r".*", "replicate"),
)
BATCH_AXES = ("data", "fsdp")


def make_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A mesh from `[(name, size), ...]`; one size may be -1 to take the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    names = tuple(name for name, _ in axes)
    sizes = [int(size) for _, size in axes]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {list(axes)}: at most one axis may have size -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh {list(axes)}: {len(devices)} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {list(axes)} has {int(np.prod(sizes))} slots for {len(devices)} devices; use -1 on one axis")
    return jax.make_mesh(tuple(sizes), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names), devices=devices)


def _fsdp_spec(shape: Sequence[int], fsdp_size: int, min_fsdp_size: int) -> P:
    if fsdp_size == 1 or int(np.prod(shape)) < min_fsdp_size:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp_size == 0:
            return P(*[("fsdp" if d == dim else None) for d in range(len(shape))])
    return P()


def spec_for(path: str, shape: Sequence[int], mesh: jax.sharding.Mesh, rules=DEFAULT_RULES, min_fsdp_size: int = 2**14) -> P:
    """The PartitionSpec of one parameter by the first rule whose regex matches its path."""
    for pattern, spec in rules:
        if re.search(pattern, path):
            if spec == "replicate":
                return P()
            if spec == "fsdp":
                return _fsdp_spec(shape, mesh.shape.get("fsdp", 1), min_fsdp_size)
            spec = tuple(spec)
            if len(spec) != len(shape):
                raise ValueError(f"partition rule {pattern!r} -> {spec} has {len(spec)} entries for {path} of shape {tuple(shape)}")
            return P(*spec)
    raise ValueError(f"no partition rule matches parameter {path!r}; end the rules with ('.*', 'replicate')")


def tree_shardings(tree: Any, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES, min_fsdp_size: int = 2**14) -> Any:
    """A pytree of NamedShardings mirroring `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(path_str(path), x.shape, mesh, rules, min_fsdp_size)), tree)


def path_str(path) -> str:
    """A pytree key path as 'a/b/0/kernel' (dict keys, attribute names and indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def init_sharded(init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES, min_fsdp_size: int = 2**14):
    """Run `init_fn(rng) -> params` already sharded: shapes from `jax.eval_shape`, shardings from
    the rules, then `jax.jit(init_fn, out_shardings=...)`, so no device ever holds the full tree
    unless the rules replicate it. Returns (params, shardings)."""
    abstract = jax.eval_shape(init_fn, rng)
    shardings = tree_shardings(abstract, mesh, rules, min_fsdp_size)
    params = jax.jit(init_fn, out_shardings=shardings)(rng)
    return params, shardings


def put_global(tree: Any, shardings: Any) -> Any:
    """Host values (numpy, or arrays on one local device) -> global arrays with `shardings`, each process
    placing its own devices' pieces. Every process must pass the same values (base weights, replicated state)."""
    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree_util.tree_map(put, tree, shardings)


def batch_sharding(mesh: jax.sharding.Mesh, axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """Leading (batch) axis split over the data-parallel axes present in the mesh."""
    present = tuple(a for a in axes if a in mesh.shape)
    return NamedSharding(mesh, P(present))


def batch_shards(mesh: jax.sharding.Mesh, axes: Sequence[str] = BATCH_AXES) -> int:
    """How many pieces `batch_sharding` cuts the leading axis into (the product of the batch axes' sizes)."""
    return int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape]))


def to_row_chunks(x: jax.Array, num_chunks: int, shards: int) -> jax.Array:
    """[B, ...] batch-sharded in `shards` contiguous pieces -> [num_chunks, B / num_chunks, ...], chunk `i`
    holding rows `i * per .. (i + 1) * per - 1` of every piece (`per = B / (shards * num_chunks)`): every chunk
    spans every shard, so a loop over the chunks moves no data between devices (`map_row_chunks`)."""
    b = x.shape[0]
    if b % (shards * num_chunks):
        raise ValueError(f"a batch of {b} rows cannot be cut into {num_chunks} chunks over {shards} batch shards")
    per = b // (shards * num_chunks)
    return x.reshape((shards, num_chunks, per) + x.shape[1:]).swapaxes(0, 1).reshape((num_chunks, shards * per) + x.shape[1:])


def from_row_chunks(chunks: Sequence[jax.Array], shards: int) -> jax.Array:
    """The inverse of `to_row_chunks`: the `num_chunks` chunks [shards * per, ...] -> the batch [B, ...] in row order."""
    n, rows = len(chunks), chunks[0].shape[0]
    x = jnp.stack(chunks).reshape((n, shards, rows // shards) + chunks[0].shape[1:])
    return x.swapaxes(0, 1).reshape((n * rows,) + chunks[0].shape[1:])


def map_row_chunks(fn: Callable, inputs: Any, num_chunks: int, shards: int, sharding: NamedSharding | None = None) -> Any:
    """Inside jit: `fn(i, chunk_inputs) -> chunk_outputs` over the `num_chunks` row chunks of `inputs` (batch-leading
    pytree; chunk i as `to_row_chunks` cuts it, spanning every shard), one chunk at a time (`lax.fori_loop`), each
    chunk's outputs written into buffers already in the rows' own order (no stacked outputs to transpose back).
    `sharding`: the batch's, for the buffers."""
    chunked = jax.tree_util.tree_map(lambda a: to_row_chunks(a, num_chunks, shards), inputs)
    take = lambda i: jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), chunked)  # noqa: E731
    shapes = jax.eval_shape(fn, 0, take(0))

    def empty(s):
        per = s.shape[0] // shards
        buffer = jnp.zeros((shards, num_chunks, per) + s.shape[1:], s.dtype)
        return jax.lax.with_sharding_constraint(buffer, sharding) if sharding is not None else buffer

    def body(i, buffers):
        out = fn(i, take(i))
        return jax.tree_util.tree_map(lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o.reshape((shards, 1) + b.shape[2:]), i, 1),
                                      buffers, out)

    buffers = jax.lax.fori_loop(0, num_chunks, body, jax.tree_util.tree_map(empty, shapes))
    return jax.tree_util.tree_map(lambda b: b.reshape((b.shape[0] * b.shape[1] * b.shape[2],) + b.shape[3:]), buffers)


def constrain_rows(tree: Any, sharding: NamedSharding | None, rows: int) -> Any:
    """Inside jit: every leaf with a leading axis of `rows` sharded by `sharding` (the batch axes), the others as they
    are; nothing when `sharding` is None or `rows` does not divide over its batch shards."""
    if sharding is None or rows % batch_shards(sharding.mesh):
        return tree
    return jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, sharding) if a.ndim and a.shape[0] == rows else a, tree)


def shard_batch(batch: Any, mesh: jax.sharding.Mesh, axes: Sequence[str] = BATCH_AXES) -> Any:
    """Place a host batch (pytree of arrays, global batch on the leading axis) onto the mesh.

    Single process: a plain `device_put`. Multi-process: every process passes its own slice of
    the global batch (`process_batch_slice`) and gets back global `jax.Array`s."""
    sharding = batch_sharding(mesh, axes)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def process_batch_slice(global_batch_size: int) -> slice:
    """This process's rows of the global batch (equal contiguous slices)."""
    n = jax.process_count()
    if global_batch_size % n:
        raise ValueError(f"global batch {global_batch_size} is not divisible by {n} processes")
    per = global_batch_size // n
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")  # clusters whose peers JAX's own detection finds
TPU_WORKERS_ENV = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")  # the TPU runtime's worker list (GKE), JAX's order
DEFAULT_COORDINATOR_PORT = "8482"  # JAX's own for TPU slices (jax/_src/clusters/cloud_tpu_cluster.py)
DISTRIBUTED_TIMEOUT_S = 300  # jax.distributed.initialize's own default deadline


def parse_switch(value: Any, key: str = "distributed") -> bool | str:
    """`config.distributed` as ml_collections users write it: "auto", or a boolean that may arrive as a string
    from the command line (`--config.distributed=True` gives 'True' when the field's default is "auto")."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("true", "false", "1", "0", "yes", "no"):
        return text in ("true", "1", "yes")
    raise ValueError(f"config.{key}={value!r}: choose auto, True or False")


TPU_PCI_DEVICE_IDS = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")  # v3 .. TPU7x, as JAX lists them


def on_tpu_vm(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """A Cloud TPU VM: a TPU chip on the PCI bus (Google's vendor id 0x1ae0 with a TPU device id), the test JAX's own
    `hardware_utils` makes, without starting a backend."""
    import glob

    for vendor in glob.glob(os.path.join(pci_root, "*", "vendor")):
        with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
            if f.read().strip() == "0x1ae0" and g.read().strip() in TPU_PCI_DEVICE_IDS:
                return True
    return False


def tpu_workers() -> list[str]:
    """The hosts of this TPU slice, in process order, from the TPU runtime's environment where it sets one (GKE, the
    simulated pod); [] elsewhere. On a Cloud TPU VM JAX's own detection finds them (`distributed_plan`)."""
    for var in TPU_WORKERS_ENV:
        if os.environ.get(var):
            return [h.strip() for h in os.environ[var].split(",") if h.strip()]
    return []


def distributed_plan(enabled: bool | str = "auto") -> dict | None:
    """The arguments of `jax.distributed.initialize` for this process, or None when it is a single process.

    - `JAX_COORDINATOR_ADDRESS` (+ `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`): by hand, any platform (CPU uses gloo).
    - A Cloud TPU VM (`on_tpu_vm`), single host or pod slice: always, no arguments: JAX's own detection reads the
      metadata server (with its own retries) or the runtime's environment (GKE). Always, because one missed metadata
      read must not turn a pod's process into a lone one (it would fail later in orbax's barrier), and because JAX's
      preemption service (SIGTERM, `preemption_noticed`) comes with the distributed client.
    - Off a TPU VM, a TPU runtime's environment of more than one worker (`tpu_workers`: the simulated pod,
      `tpu_scripts/standin/`): the values JAX's detection derives from it: the first worker, `JAX_COORDINATOR_PORT`
      (default 8482), the worker count and `TPU_WORKER_ID`.
    - SLURM / Open MPI: no arguments, JAX's own detection.
    A laptop or a GPU box: None. `enabled` True forces an initialize (JAX's detection with whatever the environment
    gives), False never."""
    enabled = parse_switch(enabled)
    if enabled is False:
        return None
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return {name: int(os.environ[var]) for name, var in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID"))
                if os.environ.get(var)}
    if on_tpu_vm():
        return {}
    workers = tpu_workers()
    if len(workers) > 1:
        port = os.environ.get("JAX_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT)
        return {"coordinator_address": f"{workers[0]}:{port}", "num_processes": len(workers),
                "process_id": int(os.environ.get("TPU_WORKER_ID", "0"))}
    if any(os.environ.get(k) for k in CLUSTER_ENV) or enabled is True:
        return {}
    return None


class DistributedStartError(RuntimeError):
    """The processes of a multi-process run did not form their group in time (one line)."""


def maybe_initialize_distributed(enabled: bool | str = "auto", timeout_s: int = DISTRIBUTED_TIMEOUT_S) -> None:
    """`jax.distributed.initialize()` on multi-process runs (`distributed_plan`), once, before anything touches a
    JAX backend. Processes that have not formed their group after `timeout_s` end with one line naming the
    coordinator and exit code 2; a backend already started is a RuntimeError saying so."""
    if jax.distributed.is_initialized():
        return
    plan = distributed_plan(enabled)
    if plan is None:
        return
    where = plan.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS") or "found by JAX's cluster detection"
    message = (f"the {plan.get('num_processes', 'all')} processes did not form a group within {timeout_s} s (coordinator {where}): "
               "start the same command on every worker at once (tpu_scripts/train.sh does)")
    # Past its deadline JAX's coordination client aborts the process (a C++ fatal error and a stack trace, not a Python
    # exception), so a watchdog of ours says it in one line first and exits; JAX's own deadline is set a little later.
    watchdog = threading.Timer(timeout_s, lambda: (print(f"flowrl_jax: error: {message}", file=sys.stderr, flush=True), os._exit(2)))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**plan, initialization_timeout=int(timeout_s) + 30)
    except RuntimeError as e:
        if "before any JAX" in str(e):
            raise RuntimeError("jax.distributed.initialize() came after a JAX backend was started in this process: "
                               "initialize first (flowrl_jax.main does, before the job runs)") from None
        raise DistributedStartError(f"{message} [{str(e).strip().splitlines()[0][:200]}]") from None
    finally:
        watchdog.cancel()


def preemption_service_running() -> bool:
    """Whether JAX's preemption service watches SIGTERM in this process (a distributed client with the service on)."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


def preemption_noticed(count: int) -> bool:
    """JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`, as MaxText watches it): True on every
    process at the same call once any process got a preemption notice (SIGTERM). `count` is the calls' counter, the same
    on every process and counted from this process's start (the service reports each process's last count and picks the
    next as the sync point: a count from a resumed step would never meet it). False without the service."""
    if not preemption_service_running():
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(count))


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in global order (numpy). Single process:
    the whole array. Multi-process: the addressable shards, deduplicated, which are the rows of
    `process_batch_slice` when the mesh's devices are ordered by process (as `jax.make_mesh` does)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    shards = {}
    for s in x.addressable_shards:
        shards.setdefault(s.index[0].start or 0, s)
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])


def global_from_local(local: np.ndarray, mesh: jax.sharding.Mesh, axes: Sequence[str] = BATCH_AXES) -> jax.Array:
    """The inverse of `local_rows`: every process's rows (e.g. host-computed rewards) as one global
    array sharded on the batch axes, so statistics over it (group advantages) see all processes."""
    return shard_batch(np.asarray(local), mesh, axes)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole global array on every process's host (small arrays: rewards, statistics)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def agree(flags: dict[str, bool]) -> dict[str, bool]:
    """Every process's flags OR-ed together, the same answer on every process: one small allgather (nothing with one
    process). What the train loop's stop decisions go through, so no host stops while another enters the next
    iteration's collectives (a pod would hang there)."""
    if jax.process_count() == 1:
        return dict(flags)
    from jax.experimental import multihost_utils

    names = sorted(flags)
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray([bool(flags[n]) for n in names], np.int32)))
    return dict(zip(names, (bool(v) for v in gathered.reshape(-1, len(names)).any(0))))


def from_process_0(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` (a numpy array, the same shape and dtype on every process) on every process."""
    if jax.process_count() == 1:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
