"""Hand FLOP count of one MMDiT forward pass (multiply-add = 2 FLOPs).

Every dense kernel `[in, out]` costs `2 * rows * in * out`, with rows = tokens of the stream it
acts on: image-stream layers (patch embedding, to_q/k/v/to_out, attn2, ff, proj_out) act on
`B * N` rows, text-stream layers (context_embedder, add_*_proj, to_add_out, ff_context) on
`B * L`, conditioning layers (time/text MLPs, adaLN modulations) on `B`. Attention adds
`QK^T` and `softmax(.) V`: `2 * 2 * B * S^2 * D` for S = N + L in the joint attention and S = N in
a dual block's image-only attention. Norms, activations and softmax are ignored (< 1%).
A training step (forward + backward) costs 3x the forward: the backward pass computes both the
input and the weight gradient of every matmul.
"""
from __future__ import annotations

import re

import flax

_TEXT = re.compile(r"(^context_embedder|/add_[qkv]_proj|/to_add_out|/ff_context/)")
_COND = re.compile(r"(^time_linear|^text_linear|/linear$|^norm_out)")


def forward_flops(model, params, batch: int, height: int, width: int, text_len: int) -> float:
    """FLOPs of `model.apply(params, x [batch, height, width, C], ...)` (params may be shapes)."""
    n = (height // model.patch_size) * (width // model.patch_size)
    total = 0.0
    for path, x in flax.traverse_util.flatten_dict(dict(params), sep="/").items():
        if not path.endswith("kernel"):
            continue
        module = path[: -len("/kernel")]
        rows = batch if _COND.search(module) else batch * text_len if _TEXT.search(module) else batch * n
        total += 2.0 * rows * x.shape[0] * x.shape[1]
    d = model.inner_dim
    dual = len(set(model.dual_attention_layers))
    total += model.num_layers * 4.0 * batch * (n + text_len) ** 2 * d
    total += dual * 4.0 * batch * n**2 * d
    return total
