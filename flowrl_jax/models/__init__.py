"""The DiT and its weights: `mmdit` (model), `convert` (diffusers weights), `lora` (adapters)."""
import jax.numpy as jnp

from flowrl_jax import parallel
from flowrl_jax.models import convert
from flowrl_jax.models.mmdit import MMDiT, patchify, unpatchify

_NON_MODULE_FIELDS = ("weights",)


def build_mmdit(model_config) -> MMDiT:
    """`config.model` (dtype names as strings) -> MMDiT."""
    kwargs = {k: v for k, v in dict(model_config).items() if k not in _NON_MODULE_FIELDS}
    for key in ("dtype", "param_dtype"):
        kwargs[key] = jnp.dtype(kwargs[key])
    kwargs["dual_attention_layers"] = tuple(kwargs.get("dual_attention_layers") or ())
    return MMDiT(**kwargs)


def create_params(model_config, mesh, rules, min_fsdp_size: int, rng):
    """Build the MMDiT of `config.model` and its params already sharded on `mesh`: loaded from the
    diffusers folder `model_config.weights` when set (its config.json defines the shape), else a
    fresh init. Returns (model, params, shardings)."""
    model = build_mmdit(model_config)
    if model_config.weights:
        model, host_params = convert.load_diffusers(model_config.weights, dtype=model.dtype, param_dtype=model.param_dtype,
                                                    remat=model.remat, lora_alpha=model.lora_alpha)
        shardings = parallel.tree_shardings(host_params, mesh, rules, min_fsdp_size)
        return model, parallel.put_global(host_params, shardings), shardings
    dummy = model.dummy_inputs()
    params, shardings = parallel.init_sharded(lambda r: model.init(r, *dummy)["params"], rng, mesh, rules, min_fsdp_size)
    return model, params, shardings
