"""AdaGRPO cross-level advantage fusion (docs/math.md §3 `adaptive`).

    A = alpha A_in + (1 - alpha) A_global,   A_global = clip((r - mu_G) / (sigma_G + 1e-4))

`A_in` is the incoming (group-relative, or a previous scheme's) advantage; `mu_G`, `sigma_G` are an EMA
(decay `decay`) of the batch reward mean and std over iterations, kept in the checkpointed train state,
so the global term is positive for the whole batch when the policy really improved. The batch's own
statistics stand in on the first iteration; the EMA is updated after use. `alpha = 1` is plain
group advantages.
"""
from __future__ import annotations

import jax.numpy as jnp

DEFAULTS = {"alpha": 0.5, "decay": 0.9, "clip": 5.0}


def init(options) -> dict:
    return {"mean": jnp.zeros((), jnp.float32), "var": jnp.ones((), jnp.float32), "count": jnp.zeros((), jnp.int32)}


def apply(inputs: dict, adv, state, options):
    alpha, decay, clip = (float(options[k]) for k in ("alpha", "decay", "clip"))
    r = inputs["rewards"].astype(jnp.float32)
    batch_mean, batch_var = jnp.mean(r), jnp.var(r)
    seen = state["count"] > 0
    mean = jnp.where(seen, state["mean"], batch_mean)
    var = jnp.where(seen, state["var"], batch_var)
    a_global = jnp.clip((r - mean) / (jnp.sqrt(var) + 1e-4), -clip, clip)
    fused = alpha * adv + (1 - alpha) * a_global[:, None, None]
    new_state = {"mean": jnp.where(seen, decay * mean + (1 - decay) * batch_mean, batch_mean),
                 "var": jnp.where(seen, decay * var + (1 - decay) * batch_var, batch_var), "count": state["count"] + 1}
    return fused, new_state
