"""Parity with diffusers' AutoencoderKL (PyTorch): the acceptance test of the VAE port.

Tiny random diffusers VAEs (SD3's block types, latent width and scaling/shift factors) are saved with
`save_pretrained`, loaded by `vae.load` (no torch on that path), and both run the same inputs.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from flowrl_jax.models import convert, vae  # noqa: E402

TINY = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=16,
            norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609)
CASES = {
    "sd3": {},  # SD3's layout: no quant convs, mid-block attention
    "quant_convs": dict(use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=False, layers_per_block=2),
}

# The project's parity bar against diffusers (WORKSPACE_NOTES.md): max|ours - ref| / max|ref| < 1e-4 = 840 float32 eps
# (1.2e-7). Both sides run the same float32 math in another summation order: the longest path (decode) is ~17 layers
# whose reductions are <= 3*3*16 = 144 terms (a conv) or 64 (attention over 8x8 pixels), so a random-walk bound is
# ~eps * 17 * sqrt(144) = 2.4e-5: measured 6.1e-7 to 1.5e-6 (5-13 eps) over both cases, ~70x below the bar, itself
# ~10,000x below a porting error (a wrong weight, layout, padding or eps is O(1)).
PARITY = 1e-4


def _diffusers_vae(seed=0, **overrides):
    torch.manual_seed(seed)
    model = diffusers.AutoencoderKL(**{**TINY, **overrides}).eval()
    with torch.no_grad():  # move every weight off its init (norms start at 1/0 and would hide a scale/bias swap)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _images_and_latents(batch=2, size=16, seed=0):
    """NCHW (torch layout): images [B, 3, 16, 16] in [-1, 1], latents [B, 16, 8, 8] (two blocks: one downsample, f = 2)."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1, 1, (batch, 3, size, size)).astype(np.float32)
    latents = rng.standard_normal((batch, TINY["latent_channels"], size // 2, size // 2)).astype(np.float32)
    return images, latents


def _torch_reference(model, images, latents):
    with torch.no_grad():
        posterior = model.encode(torch.from_numpy(images)).latent_dist
        decoded = model.decode(torch.from_numpy(latents)).sample
    return posterior.mean.numpy(), posterior.logvar.numpy(), decoded.numpy()


def _nhwc(x):
    return jnp.asarray(x.transpose(0, 2, 3, 1))


def _nchw(x):
    return np.asarray(x, np.float32).transpose(0, 3, 1, 2)


def _jax_forward(model, params, images, latents):
    variables = {"params": params}
    mean, logvar = jax.jit(lambda v, x: model.apply(v, x, method="encode"))(variables, _nhwc(images))
    decoded = jax.jit(lambda v, z: model.apply(v, z, method="decode"))(variables, _nhwc(latents))
    return _nchw(mean), _nchw(logvar), _nchw(decoded)


def _rel_err(out, ref):
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def sd3_reference(tmp_path_factory):
    """(diffusers model, pipeline folder holding vae/ saved in shards) for the SD3 case."""
    reference = _diffusers_vae()
    folder = tmp_path_factory.mktemp("pipeline")
    reference.save_pretrained(folder / "vae", max_shard_size="20KB")
    assert (folder / "vae" / "diffusion_pytorch_model.safetensors.index.json").exists()
    return reference, folder


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_diffusers(case, sd3_reference, tmp_path):
    if case == "sd3":  # a pipeline folder with a sharded vae/
        reference, folder = sd3_reference
    else:  # a plain VAE folder, one safetensors file
        reference, folder = _diffusers_vae(**CASES[case]), tmp_path
        reference.save_pretrained(folder)
    model, params = vae.load(str(folder))
    assert (model.use_quant_conv, model.use_post_quant_conv) == (reference.quant_conv is not None, reference.post_quant_conv is not None)
    images, latents = _images_and_latents()
    refs = _torch_reference(reference, images, latents)
    outs = _jax_forward(model, params, images, latents)
    for name, out, ref in zip(("mean", "logvar", "decoded"), outs, refs):
        assert out.shape == ref.shape, name
        assert np.abs(ref).max() > 0.5, name  # a real signal, not a near-zero output
        assert _rel_err(out, ref) < PARITY, (name, _rel_err(out, ref))


def test_bfloat16_decode_against_float32_reference(sd3_reference):
    reference, folder = sd3_reference
    model, params = vae.load(str(folder), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert jax.tree_util.tree_leaves(params)[0].dtype == jnp.bfloat16
    images, latents = _images_and_latents()
    _, _, ref = _torch_reference(reference, images, latents)
    out = _nchw(jax.jit(lambda p, z: model.apply({"params": p}, z, method="decode"))(params, _nhwc(latents)))
    # bfloat16 keeps 8 significant bits: unit roundoff u = 2^-9 = 2e-3. Decoding rounds weights and activations at ~17
    # layers along its path (conv_in, 2 mid resnets x 2 convs, 4 attention denses, 2 up blocks x 2 resnets x 2 convs, the
    # upsample, conv_out); independent roundings give ~u * sqrt(2 * 17) = 1.2e-2 relative, and the max over 1536 outputs
    # a few times that where |ref| is largest: measured 1.4e-2 (3.6 bf16 eps, 2^-8; 1.8e-2 on the quant_convs case). Bound
    # 5e-2: ~3x margin, still 20x below a porting error; float32 group norms and attention logits stop growth with depth.
    assert _rel_err(out, ref) < 5e-2, _rel_err(out, ref)


def test_dit_latents_follow_the_sd3_pipeline(sd3_reference):
    reference, _ = sd3_reference
    model = vae.config_from_json(dict(reference.config))
    mean = np.random.default_rng(0).standard_normal((1, 2, 2, 16)).astype(np.float32)
    scale, shift = reference.config.scaling_factor, reference.config.shift_factor
    latents = vae.to_dit_latents(model, mean)
    # One subtract and one multiply (or divide and add) in float32: <= 2 roundings of values |x| <~ 8, atol 1e-5 ~ 10 ulp.
    np.testing.assert_allclose(latents, (mean - shift) * scale, rtol=0, atol=1e-5)  # 2 roundings of |x| < 8: ~1e-6 << 1e-5
    # StableDiffusion3Pipeline decodes `latents / scaling_factor + shift_factor`: the round trip returns the mean.
    np.testing.assert_allclose(vae.from_dit_latents(model, latents), mean, rtol=0, atol=1e-5)  # 4 roundings of |x| < 8: ~2e-6
    no_shift = vae.config_from_json({**dict(reference.config), "shift_factor": None})
    np.testing.assert_allclose(vae.to_dit_latents(no_shift, mean), mean * scale, rtol=0, atol=1e-5)  # 1 rounding of |x| < 8


def test_unknown_missing_and_mis_shaped_keys_are_listed(sd3_reference):
    reference, _ = sd3_reference
    model = vae.config_from_json(dict(reference.config))
    state = dict(reference.state_dict())
    state["encoder.mid_block.attentions.0.query.weight"] = torch.zeros(16, 16)  # a pre-0.14 attention name
    del state["decoder.conv_out.bias"]
    state["decoder.up_blocks.1.resnets.0.conv1.weight"] = torch.zeros(8, 16, 1, 1)
    with pytest.raises(convert.ConversionError) as err:
        vae.from_state_dict(model, state)
    for key in ("encoder.mid_block.attentions.0.query.weight", "decoder.conv_out.bias", "decoder.up_blocks.1.resnets.0.conv1.weight"):
        assert key in str(err.value)
    with pytest.raises(convert.ConversionError, match="quant_conv"):  # weights of a VAE with quant convs, config without
        vae.from_state_dict(model, _diffusers_vae(use_quant_conv=True, use_post_quant_conv=True).state_dict())


def test_config_and_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        vae.load(str(tmp_path))
    config = {**TINY, "_class_name": "AutoencoderKL", "sample_size": 32, "force_upcast": True, "latents_mean": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors"):
        vae.load(str(tmp_path))
    with pytest.raises(convert.ConversionError, match="not_a_field"):
        vae.config_from_json({**config, "not_a_field": 1})
    with pytest.raises(convert.ConversionError, match="latents_mean"):
        vae.config_from_json({**config, "latents_mean": [0.0] * 16})
    images = jnp.zeros((1, 4, 4, 3))
    for bad, match in ((dict(down_block_types=("DownBlock2D",) * 2), "DownBlock2D"), (dict(act_fn="mish"), "mish")):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda: vae.config_from_json({**config, **bad}).init(jax.random.PRNGKey(0), images))
