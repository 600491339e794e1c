"""Softmax attention implementations, selected by name (`config.model.attention`, the MMDiT's `attention` field).

    out = attend(q, k, v, "xla")        # q/k/v [B, S, H, d] -> [B, S, H, d], scale d ** -0.5, no mask

- `xla`: plain XLA, laid out for the CPU; any backend and dtype; materializes [B H, S, S] float32 scores and their exp.
- `cudnn`: cuDNN flash attention via `jax.nn.dot_product_attention`; CUDA GPUs, bf16/fp16 only; O(S d) memory.
- `splash`: Pallas TPU splash attention (Pallas interpreter on CPU, for tests); S padded to its block; O(S d) memory.

SD3.5-M at 1024 px (S = 4,429, 24 heads of 64): xla holds 3.8 GB per image per block, cudnn 0.014, splash 0.12
(`python benchmarks/memory_plan.py --attention`). The requirements and what happens when they are not met are in
`cudnn_requirements` and `splash_attention`; neither falls back silently (a wrong backend, or cudnn's dtype, raises
naming the fix). All have a backward (jax's custom VJPs for cudnn and splash); tests/test_attention.py checks each
against `xla`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

IMPLEMENTATIONS = ("xla", "cudnn", "splash")

SPLASH_BLOCK = 512  # splash's q/kv tile (forward and backward): S is padded up to a multiple of it (min(this, S to 128))


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention, q/k/v [B, S, H, d] -> [B, S, H, d], laid out for the CPU: heads-major batched
    matmuls `[B H, S, d]`, the softmax left unnormalized (`exp(s - max)`, max without gradient) and the
    division done on the `[.., S, d]` output instead of the `[.., S, S]` probabilities. Same function as
    `jax.nn.dot_product_attention` (tested); on 2 CPU cores at the quickstart's shapes ~3x faster forward
    and ~20% faster forward+backward (WORKSPACE_NOTES.md, issue 7)."""
    b, s, h, d = q.shape
    q, k, v = (x.transpose(0, 2, 1, 3).reshape(b * h, s, d) for x in (q, k, v))
    logits = jnp.einsum("bqd,bkd->bqk", q * jnp.asarray(d**-0.5, q.dtype), k, preferred_element_type=jnp.float32)
    weights = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    out = jnp.einsum("bqk,bkd->bqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out / weights.sum(-1, keepdims=True)).astype(v.dtype)
    return out.reshape(b, h, s, d).transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------------- cudnn (GPU)

def cudnn_requirements(q: jax.Array, backend: str) -> str | None:
    """Why cuDNN flash attention cannot run `q` [B, S, H, d] on `backend` (None: it can). From jax's
    `_src/cudnn/fused_attention_stablehlo.py` (`check_layout`, `check_is_flash_attention`): CUDA only, q/k/v
    fp16/bf16 of one dtype, head_dim a multiple of 8 and <= 128 (<= 256 on Hopper and later, checked by jax
    itself); no sequence-length constraint without a bias. float32 raises rather than being cast to bf16 and back: the
    config asked for float32 compute (and the casts would copy q/k/v and the output)."""
    if backend != "gpu":
        return (f"attention='cudnn' is cuDNN flash attention, for CUDA GPUs; the backend is {backend!r}. "
                f"Use --config.model.attention=xla (any backend) or splash (TPU).")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return (f"attention='cudnn' needs bfloat16 or float16 q/k/v, got {q.dtype}: set --config.model.dtype=bfloat16 "
                f"(or --config.model.attention=xla for float32)")
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"attention='cudnn' needs head_dim a multiple of 8 and <= 256 (<= 128 before Hopper), got {d}"
    return None


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str | None = None) -> jax.Array:
    """`jax.nn.dot_product_attention` in our convention (layout [B, S, H, d] = its BTNH, scale d ** -0.5, no mask):
    the cudnn path with `implementation="cudnn"`, jax's XLA reference with None (what the CPU test checks)."""
    return jax.nn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, implementation=implementation)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN flash attention; a ValueError naming the fix where it cannot run (never a silent fallback). Sharding:
    jax's cuDNN primitives carry custom partitioning (and Shardy) rules: batch and heads may be sharded, S and d not
    (a ValueError from jax), so a batch-sharded jit partitions it per device with no shard_map."""
    problem = cudnn_requirements(q, jax.default_backend())
    if problem:
        raise ValueError(problem)
    return dot_product_attention(q, k, v, "cudnn")


# ---------------------------------------------------------------------------------------------------- splash (TPU)

def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def splash_block(s: int, block: int = SPLASH_BLOCK) -> int:
    """The q/kv tile for sequence length `s`: `block`, or `s` rounded up to the 128 lanes when shorter."""
    return min(block, _round_up(s, 128))


def _splash_local(q, k, v, *, interpret: bool, block: int):
    """Splash attention of one device's rows: q/k/v [B, S, H, d] -> [B, S, H, d] (no sharding logic)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, s, h, d = q.shape
    blk = splash_block(s, block)
    sp = _round_up(s, blk)
    q = q * jnp.asarray(d**-0.5, q.dtype)  # the kernel does not scale; as xla_attention (exact for d = 4^n: 16, 64)
    q, k, v = (jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, sp - s), (0, 0))) for x in (q, k, v))
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([sm.FullMask((sp, sp))] * h), block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, interpret=interpret)
    if sp == s:
        out = jax.vmap(kernel)(q, k, v)
    else:
        # Padding: real tokens segment 0, padding segment 1. Real queries see only real keys (exactly: masked logits
        # get exp(-0.7 f32max - m) = 0); padded queries see only padded keys (no empty softmax row) and are dropped.
        ids = (jnp.arange(sp) >= s).astype(jnp.int32)
        out = jax.vmap(kernel, in_axes=(0, 0, 0, None))(q, k, v, sk.SegmentIds(q=ids, kv=ids))
    return out[:, :, :s].transpose(0, 2, 1, 3)


def _split_axes(axes: dict[str, int], b: int, h: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of the mesh `axes` (name: size, in mesh order), those that split the batch (while the product divides `b`),
    then the heads (likewise `h`); any left over compute redundantly."""
    batch, heads, nb, nh = [], [], 1, 1
    for name, size in axes.items():
        if b % (nb * size) == 0:
            batch.append(name)
            nb *= size
        elif h % (nh * size) == 0:
            heads.append(name)
            nh *= size
    return tuple(batch), tuple(heads)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool | None = None,
                     block: int = SPLASH_BLOCK) -> jax.Array:
    """Pallas TPU splash attention, q/k/v [B, S, H, d] -> [B, S, H, d], scale d ** -0.5. `interpret`: None picks the
    compiled kernel on TPU and the Pallas interpreter on CPU (GPU raises: use cudnn).

    Sharding: XLA cannot partition a Pallas call (on TPU, lowering one under a multi-device jit raises "Mosaic
    kernels cannot be automatically partitioned"; the CPU interpreter all-gathers q/k/v onto every device). So when
    the inputs live on a multi-device mesh, the call runs in a `jax.shard_map` over it: the batch split over its
    axes (then the heads, where the batch does not divide), no collectives. The mesh is the inputs' own: under a jit
    of NamedSharding inputs, `jax.typeof(q).sharding.mesh` holds it, Auto axes included and with no mesh context (as
    the train job jits); else `jax.set_mesh`'s; none (single-device inputs) means one device and a plain call. Axes
    already manual (inside a caller's shard_map, which needs `check_vma=False`: jax's kernel declares no vma) stay so."""
    backend = jax.default_backend()
    if interpret is None:
        if backend not in ("tpu", "cpu"):
            raise ValueError(f"attention='splash' is a TPU Pallas kernel (interpreted on CPU for tests); the backend is "
                             f"{backend!r}: use --config.model.attention=cudnn on GPU, or xla")
        interpret = backend != "tpu"
    local = functools.partial(_splash_local, interpret=interpret, block=block)
    mesh = jax.typeof(q).sharding.mesh
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes) if not mesh.empty else set()
    axes = {} if mesh.empty else {n: s for n, s in zip(mesh.axis_names, mesh.axis_sizes) if n not in manual and s > 1}
    if not axes:
        return local(q, k, v)
    batch, heads = _split_axes(axes, q.shape[0], q.shape[2])
    spec = P(batch or None, None, heads or None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names=frozenset(axes),
                         check_vma=False)(q, k, v)


# ---------------------------------------------------------------------------------------------------- dispatch

def attend(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "xla") -> jax.Array:
    """q/k/v [B, S, H, d] -> [B, S, H, d] by `implementation` (one of `IMPLEMENTATIONS`)."""
    if implementation == "xla":
        return xla_attention(q, k, v)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v)
    if implementation == "splash":
        return splash_attention(q, k, v)
    raise ValueError(f"unknown attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
