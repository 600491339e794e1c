"""The PyTorch stack flowrl_jax is measured against: one Flow-GRPO iteration on diffusers' `SD3Transformer2DModel`.

    model = diffusers_model(jax_model, params)                  # the same weights (convert.to_state_dict)
    ref = TorchFlowGRPO(model, adapters, lora_alpha=64, cfg=3.0, clip_range=1e-4, beta=0.04, lr=3e-4)
    ro = ref.rollout(x_T, noise, cond, null, sigmas, levels)     # SDE rollout with per-step log-probs
    adv = group_advantages(rewards, group_size)
    stats = ref.update(ro, adv, cond, null, rows, steps, weight)  # one AdamW step on a minibatch of pairs

Written after Flow-GRPO's published PyTorch code, not after ours: `sde_step` is its `sde_step_with_logprob`
(the whole-image mean log-prob, `sigma_max = sigmas[1]`), the loss its clipped ratio plus `beta` times the
KL of the kernel means, `torch.optim.AdamW` over LoRA adapters, gradient clipping, an EMA. LoRA is a small
wrapper here instead of PEFT (PEFT's math, `W x + (alpha / r) B A x`, on the same joint-attention
projections). Images are NCHW, diffusers' layout; the DiT sees `timestep = 1000 sigma`.

Used by `benchmarks/compare_torch.py` (timings) and `tests/test_torch_reference.py` (equal log-probs,
advantages and losses to flowrl_jax's on the same weights and noise).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def to_torch(x, dtype=np.float32) -> torch.Tensor:
    """float32 (or `dtype`), on torch's default device (`torch.set_default_device("cuda")` for a GPU run)."""
    return torch.from_numpy(np.array(x, dtype)).to(torch.get_default_device())


def nchw(x) -> torch.Tensor:
    """[B, ..., H, W, C] (ours) -> [B, ..., C, H, W] torch."""
    return to_torch(x).movedim(-1, -3).contiguous()


def diffusers_model(jax_model, params):
    """diffusers `SD3Transformer2DModel` with our MMDiT's config and `params` (float32, eval mode, no grads)."""
    import diffusers

    from flowrl_jax.models import convert

    config = {k: getattr(jax_model, k) for k in convert.HPARAMS}
    config["dual_attention_layers"] = tuple(config["dual_attention_layers"])
    model = diffusers.SD3Transformer2DModel(**config).eval()
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in convert.to_state_dict(jax_model, params).items()}
    model.load_state_dict(state, strict=False)  # strict=False: the fixed position table is a buffer, not in `state`
    return model.requires_grad_(False)


class LoRALinear(nn.Module):
    """`base(x) + (alpha / r) B(A(x))` (PEFT's LoRA); `enabled = False` gives the base layer (the KL reference)."""

    def __init__(self, base: nn.Linear, a: np.ndarray, b: np.ndarray, alpha: float):
        super().__init__()
        self.base, self.scale, self.enabled = base, alpha / a.shape[1], True
        self.lora_A = nn.Parameter(to_torch(a.T).contiguous())  # [r, in]; ours is a [in, r]
        self.lora_B = nn.Parameter(to_torch(b.T).contiguous())  # [out, r]; ours is b [r, out]

    def forward(self, x):
        y = self.base(x)
        return y + self.scale * (x @ self.lora_A.T) @ self.lora_B.T if self.enabled else y


def add_lora(model, adapters: dict, alpha: float) -> dict[str, LoRALinear]:
    """Wrap each adapted projection of `model` in place; `adapters` is our `lora` tree
    ({'transformer_blocks_0': {'attn': {'to_q': {'a', 'b'}}}}). -> {our module path: layer}."""
    from flowrl_jax.models import convert

    wrapped = {}
    for block, modules in adapters.items():
        for name, ab in modules["attn"].items():
            path = convert.diffusers_key(f"{block}/attn/{name}/kernel")[: -len(".weight")]
            parent_path, child = path.rsplit(".", 1)
            parent = model.get_submodule(parent_path)
            layer = LoRALinear(getattr(parent, child) if not child.isdigit() else parent[int(child)],
                               np.asarray(ab["a"]), np.asarray(ab["b"]), alpha)
            if child.isdigit():
                parent[int(child)] = layer
            else:
                setattr(parent, child, layer)
            wrapped[f"{block}/attn/{name}"] = layer
    return wrapped


def sde_step(x, v, sigma, sigma_next, level, sigma_max):
    """Flow-GRPO's `sde_step_with_logprob` kernel: -> (mean, std [M, 1, 1, 1]); sigma etc. [M]."""
    col = lambda s: s.reshape(-1, 1, 1, 1)  # noqa: E731
    sigma, sigma_next, level = col(sigma), col(sigma_next), col(level)
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * torch.sqrt(-dt)


def sde_logprob(x_next, mean, std):
    """Flow-GRPO's log-prob of `x_next` under N(mean, std^2), averaged over all of an image's elements -> [M];
    0 where the step is deterministic (std = 0)."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    lp = -((x_next.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - math.log(math.sqrt(2 * math.pi))
    return torch.where(std.flatten() > 0, lp.mean(dim=(1, 2, 3)), torch.zeros(()))


def group_advantages(rewards: torch.Tensor, group_size: int, global_std: bool = True, clip: float = 5.0, eps: float = 1e-4,
                     ddof: int = 0):
    """Flow-GRPO's advantages: `(r - mean over the prompt's group) / (std + eps)`, std over the batch
    (`global_std`) or the group (population std, or torch's unbiased one with `ddof=1`, MixGRPO's), clipped; rows of
    one group are consecutive."""
    groups = rewards.reshape(-1, group_size)
    centered = (groups - groups.mean(1, keepdim=True)).flatten()
    unbiased = bool(ddof)
    std = rewards.std(unbiased=unbiased) if global_std else groups.std(1, unbiased=unbiased).repeat_interleave(group_size)
    return torch.clamp(centered / (std + eps), -clip, clip)


class TorchFlowGRPO:
    """Flow-GRPO on a diffusers model with LoRA adapters (module doc). `compile`: `torch.compile` the DiT."""

    def __init__(self, model, adapters: dict, lora_alpha: float, cfg: float, clip_range: float, beta: float, lr: float,
                 weight_decay: float = 1e-4, grad_clip: float = 1.0, ema_decay: float = 0.9, compile: bool = False,
                 kl_form: str = "flow_grpo", detach_uncond: bool = True, ema_every: int = 1, autocast: bool = False):
        self.model = model
        self.lora = add_lora(model, adapters, lora_alpha)
        self.params = [p for layer in self.lora.values() for p in (layer.lora_A, layer.lora_B)]
        self.ema = [p.detach().clone() for p in self.params]
        self.updates = 0
        self.cfg, self.clip_range, self.beta, self.grad_clip, self.ema_decay = cfg, clip_range, beta, grad_clip, ema_decay
        self.kl_form, self.detach_uncond, self.ema_every, self.autocast = kl_form, detach_uncond, ema_every, autocast
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
        self.dit = torch.compile(model) if compile else model

    def set_lora(self, enabled: bool) -> None:
        for layer in self.lora.values():
            layer.enabled = enabled

    def adapters(self) -> dict[str, np.ndarray]:
        """The current adapters in our layout, flat: {'transformer_blocks_0/attn/to_q/a': [in, r], '.../b': [r, out]}."""
        return {f"{path}/{k}": w.detach().cpu().numpy().T for path, layer in self.lora.items()
                for k, w in (("a", layer.lora_A), ("b", layer.lora_B))}

    def velocity(self, x, sigma, cond, null, detach_uncond: bool = False):
        """CFG velocity, both branches in one doubled batch; x [M, C, H, W], sigma [M], cond/null (tokens, pooled);
        `detach_uncond`: no gradient through the unconditional branch (Flow-GRPO's training forward)."""
        both = [torch.cat([c, u]) for c, u in zip(cond, null)]
        with torch.autocast(x.device.type, torch.bfloat16, enabled=self.autocast):  # `autocast`: the DiT in bf16
            out = self.dit(hidden_states=torch.cat([x, x]), encoder_hidden_states=both[0], pooled_projections=both[1],
                           timestep=1000 * torch.cat([sigma, sigma]), return_dict=False)[0].float()
        v_cond, v_null = out.chunk(2)
        if detach_uncond:
            v_null = v_null.detach()
        return v_null + self.cfg * (v_cond - v_null)

    @torch.no_grad()
    def rollout(self, x_T, noise, cond, null, sigmas, levels) -> dict:
        """x_T [B, C, H, W], noise [T, B, C, H, W], sigmas [T + 1], levels [T] -> per sample and step:
        states, next_states [B, T, C, H, W], logp [B, T]."""
        x, states, next_states, logps = x_T, [], [], []
        b = x.shape[0]
        for t in range(len(levels)):
            sigma = sigmas[t].expand(b)
            mean, std = sde_step(x, self.velocity(x, sigma, cond, null), sigma, sigmas[t + 1].expand(b), levels[t].expand(b), sigmas[1])
            x_next = mean + std * noise[t]
            states.append(x)
            next_states.append(x_next)
            logps.append(sde_logprob(x_next, mean, std))
            x = x_next
        return {"states": torch.stack(states, 1), "next_states": torch.stack(next_states, 1), "logp": torch.stack(logps, 1),
                "sigmas": sigmas, "levels": levels}

    def loss(self, ro, adv, cond, null, rows, steps, weight):
        """The clipped-ratio loss with KL on the minibatch of pairs `(rows[m], steps[m])` -> (loss, stats)."""
        x, x_next = ro["states"][rows, steps], ro["next_states"][rows, steps]
        sigma, sigma_next, level = ro["sigmas"][steps], ro["sigmas"][steps + 1], ro["levels"][steps]
        cond_mb, null_mb = [c[rows] for c in cond], [u[rows] for u in null]
        mean, std = sde_step(x, self.velocity(x, sigma, cond_mb, null_mb, self.detach_uncond), sigma, sigma_next, level, ro["sigmas"][1])
        ratio = torch.exp(sde_logprob(x_next, mean, std) - ro["logp"][rows, steps])
        a = adv[rows]
        per_pair = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - self.clip_range, 1 + self.clip_range))
        total = torch.clamp(weight.sum(), min=1.0)
        policy_loss = (weight * per_pair).sum() / total
        kl = torch.zeros(())
        if self.beta > 0:
            with torch.no_grad():
                self.set_lora(False)
                ref_mean, _ = sde_step(x, self.velocity(x, sigma, cond_mb, null_mb), sigma, sigma_next, level, ro["sigmas"][1])
                self.set_lora(True)
            # Flow-GRPO's KL divides by its std_dev_t, the kernel's std without sqrt(-dt); "exact" by the std itself
            kl_std = std / torch.sqrt(sigma - sigma_next).reshape(-1, 1, 1, 1) if self.kl_form == "flow_grpo" else std
            kl = (weight * ((mean - ref_mean) ** 2 / (2 * kl_std**2)).mean(dim=(1, 2, 3))).sum() / total
        loss = policy_loss + self.beta * kl
        clipfrac = (weight * ((ratio - 1).abs() > self.clip_range).float()).sum() / total
        return loss, {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "clipfrac": clipfrac}

    def update(self, ro, adv, cond, null, rows, steps, weight) -> dict:
        """One AdamW step (after global-norm clipping) on the loss of a minibatch, then the EMA."""
        loss, stats = self.loss(ro, adv, cond, null, rows, steps, weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.updates += 1
        decay = min(self.ema_decay, (1.0 + self.updates) / (10.0 + self.updates)) if self.updates % self.ema_every == 0 else 1.0
        with torch.no_grad():
            for e, p in zip(self.ema, self.params):
                e.mul_(decay).add_(p, alpha=1 - decay)
        return {"loss": loss.detach(), "grad_norm": grad_norm, **stats}
