"""The attention implementations (`flowrl_jax/models/attention.py`) against `xla_attention`, on the CPU: splash through
the Pallas interpreter, cudnn through the same wrapper with jax's XLA reference in place of the cuDNN kernel."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from flowrl_jax.models import attention
from flowrl_jax.models.attention import attend, xla_attention

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def _qkvg(batch=2, seq=11, heads=2, head_dim=16):
    """Random float32 q, k, v and a cotangent g [B, S, H, d]; q x 4: large logits, so the max-subtraction matters.
    S = 11 is no multiple of any block (splash pads it to 128 and masks 117 keys); d = 16: the scale 1/4 is exact."""
    q, k, v, g = (jax.random.normal(key, (batch, seq, heads, head_dim)) for key in jax.random.split(jax.random.PRNGKey(0), 4))
    return 4 * q, k, v, g


def _bounds(q, k, v, g):
    """(forward atol, (dq, dk, dv) atols elementwise) between two float32 softmax attentions of q, k, v, cotangent g:

    - logits: each side's d-term float32 dot is within d eps/2 L of exact (L = the largest sum |q c| |k| of one logit;
      the scale c = 1/4 is exact), so the two sides differ by dl <= d eps L;
    - forward: logits off by <= dl move each softmax weight by a relative <= 2 dl, and the output (a convex combination
      of v, |v_j - out| <= 2 max|v|) by <= 4 dl max|v|; each side's exp (<= 2 eps), S-term PV and normalizer sums and
      division add <= (S + 3) eps max|v|: atol = (4 dl + (2 S + 6) eps) max|v|;
    - backward: dv_j = sum_i p_ij g_i, dq_i = c sum_j p_ij (g_i.v_j - g_i.out_i) k_j, dk_j = c sum_i (same) q_i. Each
      weight p differs by a relative <= 2 dl + 2 eps L (splash recomputes it as exp(logit - logsumexp), both up to L)
      + 16 eps (exp, normalization); the dots and sums (two d-term, two S-term) round by (2 d + 2 S) eps/2 a side; out
      is off by the forward's atol. So each gradient is off by <= rho x its sum of absolute values, plus out's error
      through sum |g_i|, computed here per element."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    b, s, h, d = q.shape
    c = d**-0.5
    aq, ak, av, ag = np.abs(q * c), np.abs(k), np.abs(v), np.abs(g)
    big_l = np.einsum("bihd,bjhd->bhij", aq, ak).max()
    dl = d * EPS * big_l
    fwd_atol = (4 * dl + (2 * s + 6) * EPS) * av.max()
    logits = np.einsum("bihd,bjhd->bhij", q * c, k)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ao = np.abs(np.einsum("bhij,bjhd->bihd", p, v))
    rho = 2 * dl + 2 * EPS * big_l + 16 * EPS + (2 * d + 2 * s) * EPS
    g1 = ag.sum(-1).transpose(0, 2, 1)[..., None]  # sum_s |g_is| [b, h, i, 1]
    w = rho * (np.einsum("bihs,bjhs->bhij", ag, av) + np.einsum("bihs,bihs->bhi", ag, ao)[..., None]) + g1 * fwd_atol
    dq = c * np.einsum("bhij,bhij,bjhd->bihd", p, w, ak)
    dk = np.einsum("bhij,bhij,bihd->bjhd", p, w, aq)
    dv = rho * np.einsum("bhij,bihd->bjhd", p, ag)
    return fwd_atol, (dq, dk, dv)


def _value_and_grads(fn, q, k, v, g):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(g)


IMPLEMENTATIONS = {
    # cudnn's wrapper (layout [B, S, H, d], scale) with jax's XLA reference in place of the kernel: on a GPU the same
    # call with implementation="cudnn" (the kernel itself cannot run here).
    "cudnn": functools.partial(attention.dot_product_attention, implementation=None),
    "splash": functools.partial(attend, implementation="splash"),  # the Pallas interpreter on the CPU
}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_implementation_equals_xla_attention_with_gradients(name):
    q, k, v, g = _qkvg()
    out, grads = jax.jit(functools.partial(_value_and_grads, IMPLEMENTATIONS[name]))(q, k, v, g)
    ref, ref_grads = jax.jit(functools.partial(_value_and_grads, xla_attention))(q, k, v, g)
    fwd_atol, grad_atols = _bounds(q, k, v, g)
    # L = 21 here: forward atol 5.7e-4 on outputs up to 3.4 (measured: cudnn's wrapper 4.8e-7, splash 1.2e-6);
    # gradient atols (per element) up to 7.8e-3, 4.9e-2, 5.4e-4 for dq, dk, dv of size up to 2.9, 6.4, 4.4, at least 42x
    # each measured difference (<= 4.4e-6). Worst-case rounding bounds: the two sides mostly share one rounding order.
    np.testing.assert_allclose(out, ref, rtol=0, atol=fwd_atol)  # _bounds: (4 dl + (2 S + 6) eps) max|v|, float32 rounding
    for grad, ref_grad, atol in zip(grads, ref_grads, grad_atols):
        np.testing.assert_array_less(np.abs(np.asarray(grad) - np.asarray(ref_grad)), atol)  # _bounds' per-element atol


def test_splash_under_batch_sharded_jit_runs_per_device_without_collectives():
    """On a (data 4, fsdp 2) mesh of Auto axes, batch-sharded inputs and no mesh context (as the train job jits):
    splash runs in a shard_map over the batch, no all-gather of q/k/v (XLA cannot partition a Pallas call; unwrapped
    the interpreter would gather every row onto every device, and on TPU lowering fails). S = 128: the unpadded path."""
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v, g = jax.device_put(_qkvg(batch=8, seq=128), NamedSharding(mesh, P(("data", "fsdp"))))
    step = jax.jit(functools.partial(_value_and_grads, IMPLEMENTATIONS["splash"])).lower(q, k, v, g).compile()
    assert not re.findall(r"all-gather\(|all-to-all\(|all-reduce\(", step.as_text())
    out, grads = step(q, k, v, g)
    assert out.sharding.spec == P(("data", "fsdp"))
    ref, ref_grads = jax.jit(functools.partial(_value_and_grads, xla_attention))(q, k, v, g)
    fwd_atol, grad_atols = _bounds(q, k, v, g)  # the same derivation at S = 128: sharding changes no sum's order
    np.testing.assert_allclose(out, ref, rtol=0, atol=fwd_atol)  # _bounds: (4 dl + (2 S + 6) eps) max|v|, float32 rounding
    for grad, ref_grad, atol in zip(grads, ref_grads, grad_atols):
        np.testing.assert_array_less(np.abs(np.asarray(grad) - np.asarray(ref_grad)), atol)  # _bounds' per-element atol


def test_unavailable_kernels_raise_naming_the_fix(monkeypatch):
    q = jnp.zeros((1, 4, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="backend is 'cpu'.*attention=xla"):
        attend(q, q, q, "cudnn")
    assert "--config.model.dtype=bfloat16" in attention.cudnn_requirements(q, "gpu")
    assert attention.cudnn_requirements(q.astype(jnp.bfloat16), "gpu") is None
    assert "multiple of 8" in attention.cudnn_requirements(jnp.zeros((1, 4, 2, 20), jnp.bfloat16), "gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="backend is 'gpu'.*attention=cudnn"):
        attend(q, q, q, "splash")


def test_unknown_implementation_names_the_choices():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"unknown attention implementation 'flash'.*'xla', 'cudnn', 'splash'"):
        attend(q, q, q, "flash")
