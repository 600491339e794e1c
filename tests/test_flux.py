"""The FLUX.1 transformer (`models/flux.py`) equals diffusers' `FluxTransformer2DModel` at a tiny config made awkward on
purpose: an odd head count (3), a rotary split that is not even (4, 6, 6), a non-square image (4 x 6 tokens), several
single blocks, a guidance embedding; loop and scan (with remat) alike, weights loaded from the diffusers state_dict."""
import numpy as np
import pytest

from flowrl_jax.models import convert
from flowrl_jax.models.flux import rope_tables

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=3,
              joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
ROWS, COLS, TEXT = 4, 6, 5


def _image_ids(rows: int, cols: int) -> np.ndarray:
    """FluxPipeline._prepare_latent_image_ids: (0, row, col) per packed token, row-major."""
    ids = np.zeros((rows, cols, 3), np.float32)
    ids[..., 1], ids[..., 2] = np.arange(rows)[:, None], np.arange(cols)[None]
    return ids.reshape(rows * cols, 3)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**CONFIG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight random, O(1/sqrt(fan_in)): no zero-initialized path hides;
            if ".norm_" in name:  # q/k norm scales ~2: attention sharp enough that positions (the rotary tables) matter
                p.copy_(2.0 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1))
    rng = np.random.default_rng(0)
    inputs = dict(hidden_states=rng.standard_normal((2, ROWS * COLS, 8)).astype(np.float32),
                  encoder_hidden_states=rng.standard_normal((2, TEXT, 24)).astype(np.float32),
                  pooled_projections=rng.standard_normal((2, 12)).astype(np.float32),
                  timestep=np.asarray([0.3, 0.9], np.float32), guidance=np.asarray([3.5, 1.0], np.float32),
                  img_ids=_image_ids(ROWS, COLS), txt_ids=np.zeros((TEXT, 3), np.float32))
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, return_dict=False)[0].numpy()
    return model.state_dict(), inputs, out


@pytest.mark.parametrize("scan_blocks,remat", [("never", False), ("always", True)])
def test_forward_equals_diffusers(reference, scan_blocks, remat):
    state_dict, x, expected = reference
    model = convert.flux_from_config(CONFIG, scan_blocks=scan_blocks, remat=remat)
    params = convert.flux_from_state_dict(model, state_dict)
    rope = rope_tables(np.concatenate([x["txt_ids"], x["img_ids"]]), CONFIG["axes_dims_rope"])
    got = np.asarray(model.apply({"params": params}, x["hidden_states"], x["timestep"], x["encoder_hidden_states"],
                                 x["pooled_projections"], rope, x["guidance"]))
    assert np.abs(expected).max() > 0.1  # a real output, not a zero-initialized projection
    # float32 through 5 blocks of sums over <= 64 terms in another order (XLA vs torch): ~1e-6 of the output's scale;
    # 1e-5 is the bound, 10x that, while a wrong rotary pair order or text/image order is O(1)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_the_guidance_input_must_match_the_model(reference):
    _, x, _ = reference
    model = convert.flux_from_config({**CONFIG, "guidance_embeds": False})
    with pytest.raises(ValueError, match="no guidance embedding .*pass guidance=None"):
        model.init(__import__("jax").random.PRNGKey(0), *model.dummy_inputs()[:-1], x["guidance"][:1])
    with pytest.raises(convert.ConversionError, match="unknown keys .*guidance_embedder"):
        convert.flux_from_state_dict(model, reference[0])  # a dev checkpoint into a schnell config: one line naming it
