"""MMDiT building blocks against closed forms; whole-model parity with diffusers is in test_convert.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_inputs

from flowrl_jax.models import flops
from flowrl_jax.models.mmdit import cropped_pos_embed, patchify, sincos_pos_embed_2d, timestep_embedding, unpatchify

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def test_patchify_token_is_the_patch_slice():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8, 3))
    tokens = patchify(x, 2)
    assert tokens.shape == (2, 12, 12)
    # token k = (row i, col j) row-major over the 3 x 4 grid, elements in (p, q, C) order
    for k in (0, 5, 11):
        i, j = divmod(k, 4)
        np.testing.assert_array_equal(tokens[:, k], x[:, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, :].reshape(2, -1))
    np.testing.assert_array_equal(unpatchify(tokens, 2, 6, 8), x)


def test_patchify_rejects_indivisible_size():
    with pytest.raises(ValueError, match="not divisible"):
        patchify(jnp.zeros((1, 5, 4, 3)), 2)


def test_sincos_table_closed_form():
    dim, grid, base = 16, 6, 3
    table = sincos_pos_embed_2d(dim, grid, base)
    i, j = 4, 1  # row 4, column 1
    w = 1.0 / 10000 ** (np.arange(4) / 4.0)
    col, row = j * base / grid, i * base / grid
    expected = np.concatenate([np.sin(col * w), np.cos(col * w), np.sin(row * w), np.cos(row * w)])
    # the table is computed in float64 and stored as float32: |diff| <= eps/2 |value| (measured 2.7e-8); rtol 1e-6 = 8 eps,
    # atol 1e-7 for entries near 0
    np.testing.assert_allclose(table[i, j], expected, rtol=1e-6, atol=1e-7)
    crop = cropped_pos_embed(dim, grid, base, 2, 4)  # centre crop: rows 2..3, columns 1..4
    np.testing.assert_array_equal(crop.reshape(2, 4, dim), table[2:4, 1:5])


def test_timestep_embedding_closed_form():
    t = jnp.array([0.0, 250.0, 999.0])
    emb = timestep_embedding(t, 8)
    w = np.exp(-np.log(10000.0) * np.arange(4) / 4)
    expected = np.concatenate([np.cos(np.outer(t, w)), np.sin(np.outer(t, w))], axis=1)
    # A phase error, not a relative one: the float32 frequency w = exp(-log(1e4) i / 4) is exact at w = 1; at w = 0.1 it is
    # off by <= 3.3 eps relative (the float32 exponent -2.30 by <= eps |exponent|, exp by <= 1 eps), the product t w by eps/2
    # more, so the phase 999 * 0.1 is off by <= 99.9 * 3.8 eps = 4.5e-5 (smaller w: smaller phases). Measured 4.9e-6.
    np.testing.assert_allclose(emb, expected, rtol=0, atol=5e-5)


def test_fresh_init_predicts_zero_velocity(tiny_model):
    """adaLN-Zero: modulations and the output layer start at zero, so v == 0 before training."""
    inputs = random_inputs(tiny_model)
    params = jax.jit(tiny_model.init)(jax.random.PRNGKey(0), *inputs)["params"]
    v = jax.jit(tiny_model.apply)({"params": params}, *inputs)
    assert v.shape == inputs[0].shape and v.dtype == jnp.float32
    np.testing.assert_array_equal(v, 0.0)


def test_non_square_input_and_text_length(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model, batch=3, text_len=7, height=4, width=8)
    v = jax.jit(tiny_model.apply)({"params": tiny_params}, *inputs)
    assert v.shape == (3, 4, 8, 3) and bool(jnp.isfinite(v).all())


@pytest.mark.parametrize("layers", [2, 5])
def test_remat_matches_plain_forward_and_grad(tiny_model, tiny_params, layers):
    """Remat'd scanned blocks against the Python loop of blocks. 2 layers: each block alone (nn.remat); 5 layers, dual
    attention on 0-1: runs (0, 1), (2, 3) scanned, 4 alone."""
    if layers != 2:
        tiny_model = tiny_model.clone(num_layers=layers, dual_attention_layers=(0, 1))
        shapes = jax.eval_shape(lambda: tiny_model.init(jax.random.PRNGKey(0), *tiny_model.dummy_inputs())["params"])
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        tiny_params = jax.tree_util.tree_unflatten(treedef, [0.2 * jax.random.normal(k, a.shape) for k, a in zip(keys, leaves)])
    remat_model = tiny_model.clone(remat=True)
    inputs = random_inputs(tiny_model)

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, *inputs) ** 2)

    loop_model = tiny_model.clone(scan_blocks="never")
    l_plain, g_plain = jax.jit(jax.value_and_grad(lambda p: loss(loop_model, p)))(tiny_params)
    l_remat, g_remat = jax.jit(jax.value_and_grad(lambda p: loss(remat_model, p)))(tiny_params)
    # Remat (and the scan) runs the same ops on the same shapes (same matmul and reduction orders); only XLA's fusion may
    # differ, i.e. whether a multiply-add becomes one FMA (<= eps/2 of the product). The 2-layer forward has 69 multiplies
    # (about 35 per block): v within 69 eps/2, the loss (mean of v^2) within 69 eps = 8.2e-6 relative, scaled by layers / 2.
    # Measured 0 (2 layers).
    depth = layers / 2
    np.testing.assert_allclose(l_remat, l_plain, rtol=depth * 69 * EPS)  # FMA contraction per multiply, above
    for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_remat)):
        # forward + backward have 298 multiplies at 2 layers: <= 149 eps = 1.8e-5 of each gradient's scale, x layers / 2.
        # Measured <= 4.4 eps (2 layers).
        np.testing.assert_allclose(a, b, rtol=0, atol=depth * 149 * EPS * np.abs(a).max())  # 298 multiplies x depth


def test_bfloat16_compute_stays_close_to_float32(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model)
    v32 = jax.jit(tiny_model.apply)({"params": tiny_params}, *inputs)
    v16 = jax.jit(tiny_model.clone(dtype=jnp.bfloat16).apply)({"params": tiny_params}, *inputs)
    assert v16.dtype == jnp.float32  # velocities (and so log-probs) always leave the DiT in float32
    rel = float(jnp.abs(v16 - v32).max() / jnp.abs(v32).max())
    # bfloat16 rounds to u = 2^-8 = 3.9e-3; the 43 matmuls round ~130 tensors (inputs, kernels, outputs) to it, whose
    # independent errors add to ~sqrt(130) u = 0.045 (aligned worst case 0.5, which would test nothing). Measured 0.012, the
    # same on any CPU: bfloat16 rounding is exact IEEE, only float32 accumulation order (~1e-5) varies.
    assert 0 < rel < 0.05, rel


def test_hand_flop_count_matches_xla_cost_analysis(tiny_model, tiny_params):
    """The hand count of models/flops.py against XLA's own count of the compiled forward."""
    # blocks unrolled: XLA's cost analysis counts a while loop's body once, not once per trip
    model = tiny_model.clone(num_layers=3, dual_attention_layers=(0, 1), scan_blocks="never")
    inputs = random_inputs(model, batch=4, text_len=6, height=8, width=8)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    compiled = jax.jit(lambda p, *a: model.apply({"params": p}, *a)).lower(params, *inputs).compile()
    xla = compiled.cost_analysis()
    xla_flops = (xla[0] if isinstance(xla, list) else xla)["flops"]
    hand = flops.forward_flops(model, params, 4, 8, 8, 6)
    # not rounding: the hand count leaves out elementwise ops and reductions, 7.8% of XLA's count at this width (one FLOP
    # per element, counted from the jaxpr; measured gap 8.6%); leaving out the attention term (11%) would fail
    assert abs(hand - xla_flops) / xla_flops < 0.1, (hand, xla_flops)


def test_attention_equals_jax_dot_product_attention_with_gradients():
    """The CPU-laid-out attention (heads-major, output normalized after PV) is softmax attention."""
    from flowrl_jax.models.attention import xla_attention as attention

    q, k, v, g = (jax.random.normal(key, (3, 11, 2, 8)) for key in jax.random.split(jax.random.PRNGKey(0), 4))
    q = 4 * q  # large logits: the max-subtraction matters
    # The logits come from an 8-term dot plus a scaling placed differently: each side within 9 eps/2 S of exact, with S =
    # max sum|q k| / sqrt(8) = 21.8, so they differ by dl <= 9 eps S = 2.3e-5. A logit error moves the output by <= 2 max|v| dl
    # (softmax is shift-invariant; |v_j - out| <= 2 max|v| = 6.9), plus the 11-term PV and normalizer sums (24 eps max|v|):
    # <= 1.7e-4. Measured 5.4e-7.
    np.testing.assert_allclose(attention(q, k, v), jax.nn.dot_product_attention(q, k, v), rtol=0, atol=2e-4)
    ours = jax.grad(lambda *a: jnp.sum(attention(*a) * g), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        # the backward reuses the softmax weights (relative error <= 2 dl = 4.7e-5) and adds ~80 reduced terms (8- and
        # 11-term dots and sums): <= (2 dl + 80 eps) max|grad| = 5.6e-5 * 5.2 = 2.9e-4. Measured 3.9e-6.
        np.testing.assert_allclose(a, b, rtol=0, atol=3e-4)


@pytest.mark.parametrize("width,rank", [(8, 4), (64, 2)])
def test_lora_dense_merged_or_not_is_x_w_plus_scaled_x_a_b(width, rank):
    """Dense with adapters, whichever way `merge_lora_in_forward` picks (8 at r 4 merges, 64 at r 2 does not), equals
    `x W + bias + (alpha / r) x a b` in value and in the gradients w.r.t. a and b."""
    from flowrl_jax.models.mmdit import Dense, merge_lora_in_forward

    assert merge_lora_in_forward(width, width, rank) == (width == 8)
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    layer = Dense(width, lora_alpha=3.0)
    x = jax.random.normal(keys[0], (2, 5, width))
    params = {"kernel": jax.random.normal(keys[1], (width, width)), "bias": jax.random.normal(keys[2], (width,))}
    adapters = {"a": jax.random.normal(keys[3], (width, rank)), "b": jax.random.normal(keys[4], (rank, width))}

    def ours(ad):
        return layer.apply({"params": params, "lora": ad}, x)

    def by_hand(ad):
        return x @ params["kernel"] + params["bias"] + (3.0 / rank) * (x @ ad["a"]) @ ad["b"]

    # The two sides associate differently (merged kernel or not, scale before or after the last matmul, 2-D or 3-D dots);
    # each is within (width + rank + 2) eps/2 sum|terms| of exact, sum|terms| = |x| |W| + |bias| + s (|x| |a|) |b|
    # (max 36 at width 8, 331 at width 64): atol 6e-5 and 2.7e-3 on outputs up to 15 and 68. Measured 1.4e-6, 7.6e-6.
    ax, aw, ab = (np.abs(np.asarray(u)) for u in (x, params["kernel"], params["bias"]))
    terms = (ax @ aw + ab + (3.0 / rank) * (ax @ np.abs(adapters["a"])) @ np.abs(adapters["b"])).max()
    np.testing.assert_allclose(ours(adapters), by_hand(adapters), rtol=0, atol=(width + rank + 2) * EPS * terms)
    # A fixed random cotangent g (a linear loss) makes the gradients independent of the forward's rounding, which a
    # nonlinear loss of outputs up to 68 would amplify. Then dL/da = s x^T (g b^T) and dL/db = s (x a)^T g, associated
    # differently on the two sides (merged or not), each within (10 + width + rank) eps/2 of sum|terms| (10 rows).
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 5, width))
    g1 = jax.grad(lambda ad: jnp.sum(ours(ad) * g))(adapters)
    g2 = jax.grad(lambda ad: jnp.sum(by_hand(ad) * g))(adapters)
    ag, s = np.abs(np.asarray(g)).reshape(-1, width), 3.0 / rank
    terms = {"a": s * (ax.reshape(-1, width).T @ (ag @ np.abs(adapters["b"]).T)).max(),
             "b": s * ((ax.reshape(-1, width) @ np.abs(adapters["a"])).T @ ag).max()}
    for name in ("a", "b"):
        # atol 1.4e-4 to 1.1e-2 on gradients up to 16 and 107 (measured <= 1.5e-5)
        np.testing.assert_allclose(g1[name], g2[name], rtol=0, atol=(10 + width + rank) * EPS * terms[name])


def test_scanned_remat_applies_lora_adapters_of_every_block(tiny_model):
    """The scanned runs stack every variable collection: with LoRA adapters (random A and B) the scanned forward (the
    default) and the remat'd one equal the Python loop of blocks, and all equal the loop's forward of the merged weights."""
    from flowrl_jax.models import lora

    model = tiny_model.clone(num_layers=5, dual_attention_layers=(0, 1), scan_blocks="never")
    params = model.init(jax.random.PRNGKey(0), *model.dummy_inputs())["params"]
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(3), a.shape), params)
    adapters = lora.init_adapters(params, jax.random.PRNGKey(1), rank=2)
    adapters = jax.tree_util.tree_map(lambda a: 0.3 * jax.random.normal(jax.random.PRNGKey(2), a.shape), adapters)
    inputs = random_inputs(model)
    plain = model.apply({"params": params, "lora": adapters}, *inputs)
    scanned = jax.jit(model.clone(scan_blocks="always").apply)({"params": params, "lora": adapters}, *inputs)
    remat = jax.jit(model.clone(scan_blocks="always", remat=True).apply)({"params": params, "lora": adapters}, *inputs)
    merged = model.apply({"params": lora.merge(params, adapters, model.lora_alpha)}, *inputs)
    assert float(jnp.abs(plain - model.apply({"params": params}, *inputs)).max()) > 1e-2  # the adapters matter
    # same ops, same order (the remat test's bound, 5 layers: 5/2 x 69 eps/2 of the output's scale); merging reorders
    # each adapted matmul's sum (W + s A B) x vs W x + s (x A) B: <= K eps with K <= 4 x 16 features, 1e-4 of the scale
    scale = float(jnp.abs(plain).max())
    np.testing.assert_allclose(scanned, plain, rtol=0, atol=2.5 * 69 * EPS * scale)  # remat test's bound, 5 layers
    np.testing.assert_allclose(remat, plain, rtol=0, atol=2.5 * 69 * EPS * scale)  # remat test's bound, 5 layers
    np.testing.assert_allclose(merged, plain, rtol=0, atol=1e-4 * scale)  # reordered sums, K <= 64: 64 eps ~ 8e-6


def test_scan_blocks_auto_rule():
    """"auto" scans under remat and from SCAN_MIN_WIDTH on (the SD3 family), loops below; a wrong value is named."""
    from flowrl_jax.models.mmdit import MMDiT
    from flowrl_jax.models.presets import PRESETS

    assert not MMDiT(**PRESETS["shapes32"]).scans_blocks and MMDiT(**PRESETS["shapes32"], remat=True).scans_blocks
    assert MMDiT(**PRESETS["sd35_medium"]).scans_blocks and not MMDiT(**PRESETS["sd35_medium"], scan_blocks="never").scans_blocks
    assert MMDiT(**PRESETS["tiny"], scan_blocks="always").scans_blocks
    with pytest.raises(ValueError, match="scan_blocks='yes'"):
        MMDiT(**PRESETS["tiny"], scan_blocks="yes").scans_blocks
