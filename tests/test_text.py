"""Tokenizer and text encoder of the shapes world."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from flowrl_jax.models import text

WORDS = "a red blue circle square and left of".split()


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    tok = text.build_tokenizer(WORDS)
    tok.save_pretrained(tmp_path)
    again = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    ids, mask = text.tokenize(again, ["a red circle", "", "a Blue square", "a green circle"], max_len=6)
    cls, unk = tok.convert_tokens_to_ids("[CLS]"), tok.convert_tokens_to_ids("[UNK]")
    assert ids.shape == (4, 6) and ids.dtype == np.int32
    assert (ids[:, 0] == cls).all() and mask[1].sum() == 1  # the empty prompt is [CLS] alone
    assert tok.convert_ids_to_tokens(ids[0, :4].tolist()) == ["[CLS]", "a", "red", "circle"]
    assert ids[2, 2] == tok.convert_tokens_to_ids("blue")  # lower-cased
    assert ids[3, 2] == unk  # a word outside the vocabulary
    assert (ids[~mask] == tok.convert_tokens_to_ids("[PAD]")).all()


def test_too_long_prompt_is_an_error():
    with pytest.raises(ValueError, match="raise text.max_len"):
        text.tokenize(text.build_tokenizer(WORDS), ["a red circle left of a blue square"], max_len=5)


def test_encoder_shapes_and_padding_invariance():
    tok = text.build_tokenizer(WORDS)
    enc = text.TextEncoder(vocab_size=len(tok), max_len=10, width=16, depth=1, heads=2, out_dim=24, pooled_dim=12)
    short_ids, short_mask = text.tokenize(tok, ["a red circle"], 5)
    long_ids, long_mask = text.tokenize(tok, ["a red circle"], 10)
    params = enc.init(jax.random.PRNGKey(0), jnp.asarray(long_ids), jnp.asarray(long_mask))["params"]
    tokens_s, pooled_s = enc.apply({"params": params}, short_ids, short_mask)
    tokens_l, pooled_l = enc.apply({"params": params}, long_ids, long_mask)
    assert tokens_l.shape == (1, 10, 24) and pooled_l.shape == (1, 12)
    # Padding adds exact zeros (masked softmax weights) but changes the shapes, so float32 sums may be ordered differently:
    # the encoder has 363 reduced terms and elementwise ops (matmuls sum K = 194, sums 106, 63 elementwise; jaxpr), so
    # outputs move by <= 363 eps of their scale = 4.3e-5 relative (measured 2.3 eps). Padding leaking in is O(1).
    tol = 363 * float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(pooled_s, pooled_l, rtol=0, atol=tol * float(jnp.abs(pooled_l).max()))  # padding changes nothing
    np.testing.assert_allclose(tokens_s[:, :4], tokens_l[:, :4], rtol=0, atol=tol * float(jnp.abs(tokens_l[:, :4]).max()))
    assert float(jnp.abs(tokens_l[:, 4:]).max()) == 0.0  # padded positions carry no signal into the DiT
