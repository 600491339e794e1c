"""MMDiT building blocks against closed forms; whole-model parity with diffusers is in test_convert.py."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_inputs

from flowrl_jax.models import flops
from flowrl_jax.models.mmdit import cropped_pos_embed, patchify, sincos_pos_embed_2d, timestep_embedding, unpatchify


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
    np.testing.assert_allclose(table[i, j], expected, rtol=1e-6, atol=1e-7)
    crop = cropped_pos_embed(dim, grid, base, 2, 4)  # centre crop: rows 2..3, columns 1..4
    np.testing.assert_array_equal(crop.reshape(2, 4, dim), table[2:4, 1:5])


def test_timestep_embedding_closed_form():
    t = jnp.array([0.0, 250.0, 999.0])
    emb = timestep_embedding(t, 8)
    w = np.exp(-np.log(10000.0) * np.arange(4) / 4)
    expected = np.concatenate([np.cos(np.outer(t, w)), np.sin(np.outer(t, w))], axis=1)
    np.testing.assert_allclose(emb, expected, rtol=1e-5, atol=1e-5)


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


def test_remat_matches_plain_forward_and_grad(tiny_model, tiny_params):
    remat_model = tiny_model.clone(remat=True)
    inputs = random_inputs(tiny_model)

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, *inputs) ** 2)

    l_plain, g_plain = jax.jit(jax.value_and_grad(lambda p: loss(tiny_model, p)))(tiny_params)
    l_remat, g_remat = jax.jit(jax.value_and_grad(lambda p: loss(remat_model, p)))(tiny_params)
    np.testing.assert_allclose(l_remat, l_plain, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_remat)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_stays_close_to_float32(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model)
    v32 = jax.jit(tiny_model.apply)({"params": tiny_params}, *inputs)
    v16 = jax.jit(tiny_model.clone(dtype=jnp.bfloat16).apply)({"params": tiny_params}, *inputs)
    assert v16.dtype == jnp.float32  # velocities (and so log-probs) always leave the DiT in float32
    rel = float(jnp.abs(v16 - v32).max() / jnp.abs(v32).max())
    assert 0 < rel < 0.05, rel


def test_hand_flop_count_matches_xla_cost_analysis(tiny_model, tiny_params):
    """The hand count of models/flops.py against XLA's own count of the compiled forward."""
    model = tiny_model.clone(num_layers=3, dual_attention_layers=(0, 1))
    inputs = random_inputs(model, batch=4, text_len=6, height=8, width=8)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    compiled = jax.jit(lambda p, *a: model.apply({"params": p}, *a)).lower(params, *inputs).compile()
    xla = compiled.cost_analysis()
    xla_flops = (xla[0] if isinstance(xla, list) else xla)["flops"]
    hand = flops.forward_flops(model, params, 4, 8, 8, 6)
    assert abs(hand - xla_flops) / xla_flops < 0.1, (hand, xla_flops)


def test_attention_equals_jax_dot_product_attention_with_gradients():
    """The CPU-laid-out attention (heads-major, output normalized after PV) is softmax attention."""
    from flowrl_jax.models.mmdit import attention

    q, k, v, g = (jax.random.normal(key, (3, 11, 2, 8)) for key in jax.random.split(jax.random.PRNGKey(0), 4))
    q = 4 * q  # large logits: the max-subtraction matters
    np.testing.assert_allclose(attention(q, k, v), jax.nn.dot_product_attention(q, k, v), atol=1e-5)
    ours = jax.grad(lambda *a: jnp.sum(attention(*a) * g), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=1e-4)


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

    np.testing.assert_allclose(ours(adapters), by_hand(adapters), rtol=1e-5, atol=1e-5)
    g1 = jax.grad(lambda ad: jnp.sum(jnp.sin(ours(ad))))(adapters)
    g2 = jax.grad(lambda ad: jnp.sum(jnp.sin(by_hand(ad))))(adapters)
    for name in ("a", "b"):
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-4, atol=1e-4)
