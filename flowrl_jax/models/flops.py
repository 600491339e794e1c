"""Hand FLOP count of one MMDiT forward pass (multiply-add = 2 FLOPs).

Every dense kernel `[in, out]` costs `2 * rows * in * out`, with rows = tokens of the stream it
acts on: image-stream layers (patch embedding, to_q/k/v/to_out, attn2, ff, proj_out) act on
`B * N` rows, text-stream layers (context_embedder, add_*_proj, to_add_out, ff_context) on
`B * L`, conditioning layers (time/text MLPs, adaLN modulations) on `B`. Attention adds
`QK^T` and `softmax(.) V`: `2 * 2 * B * S^2 * D` for S = N + L in the joint attention and S = N in
a dual block's image-only attention. An unmerged LoRA adapter (`a [in, r]`, `b [r, out]`) on a kernel
adds `2 * rows * r * (in + out)`. Norms, activations and softmax are ignored (< 1%).
A full training step (forward + backward) costs 3x the forward: the backward pass computes both the
input and the weight gradient of every matmul; a LoRA update's count is `lora_update_flops`.
"""
from __future__ import annotations

import re

import flax

_TEXT = re.compile(r"(^context_embedder|/add_[qkv]_proj|/to_add_out|/ff_context/)")
_COND = re.compile(r"(^time_linear|^text_linear|/linear$|^norm_out)")


def forward_flop_parts(model, params, batch: int, height: int, width: int, text_len: int, adapters=None) -> dict:
    """{"dense", "attention", "lora"}: FLOPs of `model.apply` on x [batch, height, width, C] (module doc);
    `params` and `adapters` (the `lora` collection, unmerged) may be shapes."""
    n = (height // model.patch_size) * (width // model.patch_size)

    def rows(module: str) -> int:
        return batch if _COND.search(module) else batch * text_len if _TEXT.search(module) else batch * n

    dense = sum(2.0 * rows(path[: -len("/kernel")]) * x.shape[0] * x.shape[1]
                for path, x in flax.traverse_util.flatten_dict(dict(params), sep="/").items() if path.endswith("/kernel"))
    lora = sum(2.0 * rows(path[: -len("/a")]) * x.shape[1] * (x.shape[0] + params_out)
               for path, x, params_out in _adapters(adapters))
    d = model.inner_dim
    attention = model.num_layers * 4.0 * batch * (n + text_len) ** 2 * d
    attention += len(set(model.dual_attention_layers)) * 4.0 * batch * n**2 * d
    return {"dense": dense, "attention": attention, "lora": lora}


def _adapters(adapters):
    """(path of `a`, a [in, r], out) per adapter."""
    flat = flax.traverse_util.flatten_dict(dict(adapters or {}), sep="/")
    return [(path, a, flat[path[:-1] + "b"].shape[1]) for path, a in flat.items() if path.endswith("/a")]


def forward_flops(model, params, batch: int, height: int, width: int, text_len: int, adapters=None) -> float:
    """Total FLOPs of one forward (`forward_flop_parts` summed)."""
    return sum(forward_flop_parts(model, params, batch, height, width, text_len, adapters).values())


def lora_update_flops(model, params, pairs: int, height: int, width: int, text_len: int, adapters, kl: bool) -> float:
    """FLOPs of one Flow-GRPO update on `pairs` (sample, step) pairs with frozen base weights and LoRA `adapters`: the
    policy's CFG-pair forward (2 x pairs rows) and its backward, which computes input gradients only (dense x 1,
    attention x 2: both products' two operands, LoRA x 2: its inputs and weights), plus with `kl` the reference's
    forward without adapters: `(2 + kl) dense + (3 + kl) attention + 3 lora` of a forward on 2 x pairs rows. The count
    PEFT's unmerged adapters run (`mmdit.merge_lora_in_forward` may merge them and do more arithmetic)."""
    parts = forward_flop_parts(model, params, 2 * pairs, height, width, text_len, adapters)
    return (2 + kl) * parts["dense"] + (3 + kl) * parts["attention"] + 3 * parts["lora"]
