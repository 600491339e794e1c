"""LoRA adapters: the unmerged low-rank path equals the merged kernels, and zero adapters are a no-op."""
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_inputs

from flowrl_jax.models import lora


def test_default_targets_are_flow_grpo_attention_projections(tiny_params):
    adapters = lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4)
    modules = sorted({p.rsplit("/", 1)[0] for p in flax.traverse_util.flatten_dict(adapters, sep="/")})
    # block 0: 8 joint-attention projections; the last block is context-pre-only (no to_add_out);
    # block 0's dual attention (attn2) is not a Flow-GRPO target.
    assert len(modules) == 8 + 7
    assert "transformer_blocks_0/attn/to_add_out" in modules and not any("attn2" in m for m in modules)
    a = adapters["transformer_blocks_0"]["attn"]["to_q"]["a"]
    assert a.shape == (32, 4) and adapters["transformer_blocks_0"]["attn"]["to_q"]["b"].shape == (4, 32)


def test_zero_adapters_leave_the_output_unchanged(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model)
    adapters = lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4)
    apply = jax.jit(tiny_model.apply)
    # b = 0 makes the adapter term exactly 0 (W + s a 0 == W, also as an FMA) and the rest of both programs is the same
    # HLO on the same kernels: equal on any CPU (measured 0); 1e-6 is one ulp of max|v| = 12
    np.testing.assert_allclose(apply({"params": tiny_params, "lora": adapters}, *inputs),
                               apply({"params": tiny_params}, *inputs), rtol=0, atol=1e-6)


def test_adapters_equal_merged_weights(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model)
    adapters = lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4)
    adapters = jax.tree_util.tree_map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(2), x.shape), adapters)
    apply = jax.jit(tiny_model.apply)
    with_adapters = apply({"params": tiny_params, "lora": adapters}, *inputs)
    merged = apply({"params": lora.merge(tiny_params, adapters, alpha=tiny_model.lora_alpha)}, *inputs)
    base = apply({"params": tiny_params}, *inputs)
    assert float(jnp.abs(with_adapters - base).max()) > 1e-2  # the adapters do something (measured 12 >> the 1e-4 below)
    # Both paths fold W + s a b into the kernel in float32 (merge_lora_in_forward at width 32, r 4) and differ only in where
    # that is rounded: <= (r + 1) eps/2 = 2.5 eps per entry of the 15 adapted kernels, passed on at unit gain (normalized
    # layers): <= 15 x 2.5 eps = 4.5e-6 of max|v| = 6.7 -> 3e-5 < atol 1e-4. Measured 0.
    np.testing.assert_allclose(with_adapters, merged, rtol=1e-4, atol=1e-4)


def test_gradients_flow_to_the_adapters_only(tiny_model, tiny_params):
    inputs = random_inputs(tiny_model)
    adapters = lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4)
    grads = jax.jit(jax.grad(lambda ad: jnp.mean(tiny_model.apply({"params": tiny_params, "lora": ad}, *inputs) ** 2)))(adapters)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(adapters)
    # with b = 0 the gradient reaches b (dL/db = (x a)^T dL/dy), not a
    assert float(jnp.abs(grads["transformer_blocks_0"]["attn"]["to_q"]["b"]).max()) > 0
    assert lora.num_params(adapters) < 0.5 * lora.num_params(tiny_params)


def test_targets_matching_nothing_is_a_clear_error(tiny_params):
    with pytest.raises(ValueError, match="matches no kernel"):
        lora.init_adapters(tiny_params, jax.random.PRNGKey(0), targets=r"/no_such_layer/kernel$")


def test_gaussian_init_has_std_one_over_rank_and_zero_b(tiny_params):
    adapters = lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4, init="gaussian")
    flat = flax.traverse_util.flatten_dict(adapters, sep="/")
    a = np.concatenate([np.asarray(v).ravel() for k, v in flat.items() if k.endswith("/a")])
    b = [np.asarray(v) for k, v in flat.items() if k.endswith("/b")]
    # std of n normal draws has standard error std / sqrt(2 n); 5 of them bound it
    assert abs(a.std() - 1 / 4) < 5 * (1 / 4) / np.sqrt(2 * a.size) and abs(a.mean()) < 5 * (1 / 4) / np.sqrt(a.size)
    assert all(np.all(x == 0) for x in b)
    with pytest.raises(ValueError, match="lora_init"):
        lora.init_adapters(tiny_params, jax.random.PRNGKey(0), rank=4, init="xavier")
