"""The embedded world's text side: a word-level tokenizer and a small Flax text transformer.

    tokenizer = build_tokenizer(words)                       # transformers.PreTrainedTokenizerFast
    ids, mask = tokenize(tokenizer, prompts, max_len)        # [B, L] int32, [B, L] bool
    text_tokens, pooled = TextEncoder(...).apply({"params": p}, ids, mask)
        text_tokens [B, L, out_dim]  (the DiT's joint_attention_dim)
        pooled      [B, pooled_dim]  (the DiT's pooled_projection_dim)

Every sequence starts with `[CLS]`, so the empty prompt (the CFG null condition) is `[CLS]` alone
and still has a well-defined embedding; `pooled` is a projection of the final `[CLS]` state.
Trained jointly with the DiT in pretraining, frozen during RL. The tokenizer is saved with
`save_pretrained` beside the checkpoint and loaded with `PreTrainedTokenizerFast.from_pretrained`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import flax.linen as nn
import jax
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL = ("[PAD]", "[UNK]", "[CLS]")


def build_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `words` (lower-cased, whitespace split) with [PAD]=0, [UNK], [CLS]."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for word in sorted({w.lower() for w in words} - set(SPECIAL)):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", vocab["[CLS]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]")


def tokenize(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> (ids [B, max_len] int32, mask [B, max_len] bool); words past max_len are an error."""
    enc = tokenizer([p.lower() for p in prompts], padding="max_length", max_length=max_len, truncation=False, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(bool)
    if ids.shape[1] > max_len:
        longest = max(prompts, key=lambda p: len(p.split()))
        raise ValueError(f"prompt {longest!r} has more than {max_len - 1} words; raise text.max_len")
    return ids, mask


class TextEncoder(nn.Module):
    """Token embedding + learned positions + pre-LN transformer (padding masked); see module doc."""

    vocab_size: int
    max_len: int = 12
    width: int = 128
    depth: int = 2
    heads: int = 4
    out_dim: int = 128
    pooled_dim: int = 128

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = nn.Embed(self.vocab_size, self.width, name="embed")(ids)
        h = h + self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.width))[None, : ids.shape[1]]
        attn_mask = nn.make_attention_mask(mask, mask)
        for i in range(self.depth):
            y = nn.LayerNorm(name=f"ln_attn_{i}")(h)
            h = h + nn.MultiHeadDotProductAttention(self.heads, name=f"attn_{i}")(y, y, mask=attn_mask)
            y = nn.LayerNorm(name=f"ln_mlp_{i}")(h)
            h = h + nn.Dense(self.width, name=f"mlp_out_{i}")(nn.gelu(nn.Dense(4 * self.width, name=f"mlp_in_{i}")(y)))
        h = nn.LayerNorm(name="ln_final")(h)
        tokens = nn.Dense(self.out_dim, name="proj_tokens")(h) * mask[..., None]
        pooled = nn.Dense(self.pooled_dim, name="proj_pooled")(h[:, 0])
        return tokens, pooled
