"""`clip.load_clip` (a transformers CLIPModel folder, both towers, without torch) against transformers' `CLIPModel`.

Tiny random CLIPModels (hidden 32, patch 8 on 32x32 images, both activations) are saved with `save_pretrained` next to
a `CLIPProcessor` (transformers 5 writes `processor_config.json` + tokenizer files) and loaded by `load_clip`. Checked:
image/text embeds and the PickScore logit against `get_image_features` / `get_text_features` / `logits_per_image`,
the in-graph `CLIP.preprocess` against the processor's PIL path as a score difference, bf16 compute, gradients through
the preprocessing (finite differences, remat), the folder errors, and that loading needs no torch.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flowrl_jax import parallel  # noqa: E402
from flowrl_jax.data import shapes  # noqa: E402
from flowrl_jax.models import clip, clip_vision  # noqa: E402

WORDS = ["a", "photo", "of", "red", "blue", "cat", "dog", "circle", "square", "two"]
MAX_LEN, IMAGE, PATCH, PROJ = 16, 32, 8, 24
PROMPTS = ["a photo of a cat", "two red dogs", "a blue circle and a square"]
CASES = {  # the EOS is the largest id: the legacy rule (argmax) and the current one (first EOS) pick the same token
    "quick_gelu": dict(hidden_act="quick_gelu", legacy_eos=False),
    "gelu": dict(hidden_act="gelu", legacy_eos=True),
}

# max|ours - ref| / max|ref| < 2e-5 = 168 float32 eps, the bound of tests/test_clip_text.py, derived there for 3 pre-LN
# layers of dots over <= 64 terms (~10-50 eps expected). The vision tower adds the patch embedding (a dot over
# p*p*3 = 192 terms: a random walk of ~sqrt(192) = 14 eps at most) and a 17-token softmax, a few eps more; measured
# 3.5-4.1 eps (4.1e-7 to 4.9e-7) for both towers. A porting error (a transposed conv, a wrong token order or norm) is
# O(1).
PARITY = 2e-5
# The PickScore logit exp(s) * cos(i, t) from embeddings within PARITY: each embedding's error is at most PARITY *
# max|e| per entry, so its norm error is at most sqrt(P) * PARITY * max|e| <= sqrt(P) * PARITY * |e| (rows of like
# norms), and the cosine moves by at most the two relative errors: |d cos| <= 2 sqrt(P) PARITY = 2.0e-4 for P = 24;
# times exp(s) = 100 here: 2e-2. Measured 1.5e-5 to 2.3e-5 (errors of single entries do not all align).
LOGIT_PARITY = 2 * np.sqrt(PROJ) * PARITY
# bf16 compute against the float32 reference, as tests/test_clip_text.py's BF16_PARITY (8 eps = 3.1e-2, eps = 2^-8,
# u = eps/2): per layer ~9 roundings to bf16 of the residual stream and matmul inputs, 3 layers + the patch embedding
# and the projection here: ~32 u = 16 eps if all aligned, ~sqrt(32) u = 2.8 eps as a random walk; measured 2.5 eps
# (text) and 3.7 eps (image), 1.9-4.6 eps for the image tower over 6 pixel seeds and both activations. Bound 8 eps, half
# the aligned worst case, ~30x below a wrong port's O(1).
BF16_PARITY = 8 * 2.0**-8


def _tokenizer():
    """A byte-level BPE CLIP tokenizer over WORDS and letters (offline), EOS = pad = the largest id."""
    vocab = {"<|startoftext|>": 0}
    for token in [w + "</w>" for w in WORDS] + [c + e for c in "abcdefghijklmnopqrstuvwxyz" for e in ("", "</w>")]:
        vocab.setdefault(token, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=MAX_LEN)


def _processor(tokenizer):
    image = transformers.CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    return transformers.CLIPProcessor(image_processor=image, tokenizer=tokenizer)


def _reference(hidden_act, legacy_eos, vocab_size, seed=0):
    torch.manual_seed(seed)
    eos = vocab_size - 1
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, max_position_embeddings=MAX_LEN, hidden_act=hidden_act,
                         bos_token_id=0, eos_token_id=2 if legacy_eos else eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           image_size=IMAGE, patch_size=PATCH, hidden_act=hidden_act),
        projection_dim=PROJ)
    model = transformers.CLIPModel(config).eval()
    with torch.no_grad():  # off CLIP's init (std 0.02, unit LayerNorms, near-uniform attention), as test_clip_text.py
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.logit_scale.fill_(np.log(100.0))  # PickScore's learned scale
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: folder} of CLIPModel + processor folders, and the torch references."""
    tokenizer = _tokenizer()
    out, refs = {}, {}
    for case, kw in CASES.items():
        folder = tmp_path_factory.mktemp(case)
        refs[case] = _reference(vocab_size=len(tokenizer), **kw)
        refs[case].save_pretrained(folder)
        _processor(tokenizer).save_pretrained(folder)
        out[case] = str(folder)
    return out, refs


@pytest.fixture(scope="module")
def loaded(folders):
    paths, _ = folders
    return {case: clip.load_clip(path) for case, path in paths.items()}


def _rel_err(out, ref):
    return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


def _unit(v):
    return v / jnp.linalg.norm(v, axis=-1, keepdims=True)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers_clip_model(case, folders, loaded):
    paths, refs = folders
    reference, (model, params) = refs[case], loaded[case]
    assert model.vision.hidden_act == model.text.hidden_act == CASES[case]["hidden_act"]
    assert (model.text.projection_dim, model.vision.projection_dim, model.max_length) == (PROJ, PROJ, MAX_LEN)
    leaves = jax.tree.leaves(params)
    assert all(type(x) is np.ndarray for x in leaves), {type(x) for x in leaves}  # host numpy, on no device
    assert params["logit_scale"].dtype == np.float32 and params["logit_scale"].shape == ()

    ids = model.tokenize(PROMPTS)
    expected_ids = transformers.CLIPProcessor.from_pretrained(paths[case])(
        text=PROMPTS, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="np")["input_ids"]
    np.testing.assert_array_equal(ids, expected_ids)
    assert ids.dtype == np.int32 and ids.shape == (3, MAX_LEN)

    pixels = np.random.default_rng(0).normal(size=(3, 3, IMAGE, IMAGE)).astype(np.float32)  # NCHW, normalised scale
    with torch.no_grad():
        t_ids, t_pix = torch.from_numpy(ids).long(), torch.from_numpy(pixels)
        ref_image = reference.get_image_features(pixel_values=t_pix).pooler_output.numpy()
        ref_text = reference.get_text_features(input_ids=t_ids).pooler_output.numpy()
        ref_logits = np.diag(reference(input_ids=t_ids, pixel_values=t_pix).logits_per_image.numpy())
    assert min(np.abs(ref_image).max(), np.abs(ref_text).max()) > 0.5  # a real signal
    image = jax.jit(model.image_embeds)(params, pixels.transpose(0, 2, 3, 1))
    text = jax.jit(model.text_embeds)(params, ids)
    logits = jnp.exp(params["logit_scale"]) * jnp.sum(_unit(image) * _unit(text), -1)
    errors = dict(image=_rel_err(image, ref_image), text=_rel_err(text, ref_text),
                  logit=float(np.abs(np.asarray(logits) - ref_logits).max()))
    print(case, errors, "logits", ref_logits)
    assert max(errors["image"], errors["text"]) < PARITY, errors
    assert errors["logit"] < np.exp(params["logit_scale"]) * LOGIT_PARITY, errors
    assert np.ptp(ref_logits) > 1.0  # the prompts/images score differently: the logit test is not of a constant


def test_processor_folder_sharded_weights_and_no_torch(folders, loaded, tmp_path):
    """The model from one folder (sharded safetensors, no processor), processor + tokenizer from another (flow_grpo's
    PickScore: PickScore_v1's weights, laion's CLIP-ViT-H-14 processor); loading imports no torch."""
    paths, refs = folders
    model_dir = tmp_path / "model"
    refs["quick_gelu"].save_pretrained(model_dir, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").exists()
    with pytest.raises(FileNotFoundError, match="processor_config.json or preprocessor_config.json"):
        clip.load_clip(str(model_dir))
    model, params = clip.load_clip(str(model_dir), processor_folder=paths["gelu"])
    jax.tree.map(np.testing.assert_array_equal, params, loaded["quick_gelu"][1])
    assert model.image == loaded["gelu"][0].image and model.tokenize(["a cat"]).shape == (1, MAX_LEN)

    script = (  # torch made unimportable: any import of it on the loading path fails the subprocess
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from flowrl_jax.models import clip\n"
        f"m, p = clip.load_clip({str(model_dir)!r}, processor_folder={paths['gelu']!r})\n"
        "e = m.image_embeds(p, m.preprocess(np.zeros((1, 40, 40, 3), np.float32)))\n"
        "t = m.text_embeds(p, m.tokenize(['a cat']))\n"
        "print('ok', e.shape, t.shape, 'torch' in sys.modules and sys.modules['torch'] is not None)\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"ok (1, {PROJ}) (1, {PROJ}) False" in result.stdout, result.stdout


def test_vision_tower_folder(folders, loaded, tmp_path):
    """A CLIPVisionModelWithProjection folder (the image tower alone) loads by `clip_vision.load` to the same params."""
    _, refs = folders
    config = refs["gelu"].config.vision_config
    config.projection_dim = PROJ
    tower = transformers.CLIPVisionModelWithProjection(config).eval()
    state = {k: v for k, v in refs["gelu"].state_dict().items() if k.startswith(("vision_model.", "visual_"))}
    tower.load_state_dict(state)
    tower.save_pretrained(tmp_path)
    model, params = clip_vision.load(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, params, loaded["gelu"][1]["vision"])
    with_buffer = {**state, "vision_model.embeddings.position_ids": torch.arange(17)[None]}  # older checkpoints' buffer
    jax.tree.map(np.testing.assert_array_equal, clip_vision.from_state_dict(model, with_buffer), params)
    pixels = np.random.default_rng(2).normal(size=(2, IMAGE, IMAGE, 3)).astype(np.float32)
    with torch.no_grad():
        ref = tower(pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2))).image_embeds.numpy()
    assert _rel_err(model.apply({"params": params}, pixels), ref) < PARITY  # the bound and its derivation above
    with pytest.raises(ValueError, match="do not fit this CLIP vision model"):
        model.apply({"params": params}, pixels[:, :16])
    with pytest.raises(ValueError, match="not a CLIP vision model"):
        clip_vision.config_from_json(refs["gelu"].config.to_dict())


def _structured_images(height, width, seed=0):
    """[4, H, W, 3] float32 in [-1, 1]: shapes-world scenes (anti-aliased objects, 4x4 supersampled) plus a smooth
    colour wave, clipped: edges, flat regions, gradients and saturated pixels, as generated images have."""
    rng = np.random.default_rng(seed)
    specs = [shapes.parse_prompt(p) for p in ("a red circle and a blue square", "three triangles", "a yellow square",
                                              "a circle left of a square")]
    scenes = shapes.render_batch(specs, rng, size=max(height, width))[:, :height, :width]
    yy, xx = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    wave = np.sin(2 * np.pi * (xx[None] * rng.uniform(0.5, 1.5, (4, 1, 1)) + yy[None]))[..., None]
    return np.clip(scenes + 0.3 * wave * np.array([1.0, -0.5, 0.7]), -1, 1).astype(np.float32)


def _rounding_gains(sizes):
    """(l1 gain, l2^2 gain) of PIL's uint8 roundings on the output, over the passes that run (sizes: [(n_in, n_out)],
    horizontal first; a pass runs when the size changes): the input's rounding goes through every pass, each pass's
    through the later ones, the last is the output's. A pass's gain is its weight matrix's max row norm (the
    antialiased bicubic kernel, jax's = PIL's)."""
    norms = []
    for n_in, n_out in sizes:
        if n_in != n_out:
            weights = np.abs(np.asarray(jax.image.resize(jnp.eye(n_in), (n_out, n_in), "bicubic", antialias=True)))
            norms.append((weights.sum(1).max(), (weights**2).sum(1).max()))
    l1 = [n[0] for n in norms] + [1.0]
    l2 = [n[1] for n in norms] + [1.0]
    return (sum(np.prod(l1[k:]) for k in range(len(l1))) if norms else 1.0,
            sum(np.prod(l2[k:]) for k in range(len(l2))) if norms else 1.0)


@pytest.mark.parametrize("size", [(64, 64), (64, 48), (48, 80), (32, 32)])
def test_preprocess_matches_clip_processor(size, folders, loaded):
    """`CLIP.preprocess` on float images against CLIPImageProcessor (PIL bicubic) on their uint8 rounding, as pixels
    and as a CLIP score (cosine with a text embedding), each within a bound derived from uint8 rounding."""
    paths, _ = folders
    model, params = loaded["gelu"]
    processor = transformers.CLIPProcessor.from_pretrained(paths["gelu"]).image_processor
    assert type(processor).__name__ == "CLIPImageProcessorPil"  # transformers 5 without torchvision: PIL's resize
    images = _structured_images(*size)
    uint8 = np.round((images + 1) * 127.5).astype(np.uint8)  # what a torch reward feeds its processor
    ref = processor(images=list(uint8), return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
    ours = np.asarray(jax.jit(model.preprocess)(images))
    assert ours.shape == ref.shape == (4, IMAGE, IMAGE, 3)
    height, width = size
    new_h, new_w = model.image.resized_shape(height, width)
    l1_gain, l2_gain = _rounding_gains([(width, new_w), (height, new_h)])
    level = 1 / 255 / min(model.image.std)  # one uint8 level in normalised units (the smallest std, 0.261)

    # Pixels. The same kernel (Keys a = -0.5 widened by the downscale factor, renormalised at the borders: checked
    # against PIL on float images below) and the same two clipped passes, so only PIL's roundings to uint8 differ, each
    # <= 1/2 level: the input's (through both passes: gain <= l1_w * l1_h, the kernels' max row l1 norms, 1.18-1.19
    # here), the horizontal pass's (through the vertical one: l1_h) and the output's; without a resize (32x32) only
    # the input's. Clipping is 1-Lipschitz; PIL's 22-bit fixed-point weights add ~1e-6 of a level. Measured 1.2-1.4
    # levels on the resized sizes (bound 1.8), 0.5 without a resize (bound 0.5, +1e-4 of it for float32's rounding of
    # normalised values ~2: 2.4e-7 = 1.6e-5 of a level).
    pixel_bound = l1_gain * 0.5 * level * (1 + 1e-4)
    pixel_err = float(np.abs(ours - ref).max())

    # Score s(p) = cos(image_embeds(p), t), to first order s(ours) - s(ref) = sum_i g_i dp_i, g = ds/dp measured at the
    # reference pixels (the second order is ~|dp| = 0.02 of it, within the x2 below).
    # - Worst case (Hoelder, every error aligned with its gradient's sign): |ds| <= ||g||_1 * pixel_bound, x2: 0.05 to
    #   0.17 here, as large as the scores themselves, so it only catches gross errors.
    # - Typical: the roundings are zero-mean, uniform (variance 1/12 level^2) and independent, so each pixel's error has
    #   variance <= (l2_w^2 l2_h^2 + l2_h^2 + 1) / 12 level^2 (the same roundings through the kernels' l2 norms, 0.67 to
    #   0.77 here) and ds has std sigma <= ||g||_2 * sqrt(that). The model fits the pixels: rms differences measured
    #   0.0052-0.0057 against its <= 0.0056 (0.0040 against 0.0043 without a resize). Bound 6 sigma (1.5e-3 to 2.8e-3;
    #   independence is approximate where the wave's rounding errors correlate over a few pixels); measured 5e-6 to
    #   5.0e-4, <= 2.0 sigma. In PickScore's units (100 cos): <= 0.05 here; a real model's sensitivity ||g|| differs.
    text = model.text_embeds(params, model.tokenize(["a photo of a cat"]))

    def score(pixel_values):
        return jnp.sum(_unit(model.image_embeds(params, pixel_values)) * _unit(text), -1)

    grad = np.asarray(jax.jacrev(lambda p: score(p).sum())(jnp.asarray(ref))).reshape(4, -1)  # per image (independent)
    worst = 2 * np.abs(grad).sum(1) * pixel_bound
    sigma = np.sqrt((grad**2).sum(1) * l2_gain / 12) * level
    score_err = np.abs(np.asarray(score(ours) - score(ref)))
    print(size, f"pixels max {pixel_err:.4f} (bound {pixel_bound:.4f}) rms {np.sqrt(np.mean((ours - ref)**2)):.4f}, "
          f"score diff {score_err} = {score_err / sigma} sigma (6 sigma {6 * sigma}, worst case {worst})")
    assert pixel_err < pixel_bound, (pixel_err, pixel_bound)
    assert np.all(score_err < 6 * sigma), (score_err, sigma)
    assert np.all(score_err < worst), (score_err, worst)

    if (new_h, new_w) != (height, width):  # the kernel itself: PIL on float ("F") images, no rounding anywhere
        from PIL import Image
        channel = (images[0, :, :, 0] + 1) / 2
        pil = np.asarray(Image.fromarray(channel, mode="F").resize((new_w, new_h), Image.Resampling.BICUBIC))
        ours_f = jax.image.resize(channel, (new_h, new_w), "bicubic", antialias=True)
        # float32 sums of <= 12 taps of values <= 1 (PIL in double weights, float32 pixels): a few eps; 1e-5 = 84 eps,
        # where a different kernel (a = -0.75, no antialias, a shifted grid) differs by ~1e-2. Measured 2e-7 to 8e-7.
        assert float(np.abs(np.asarray(ours_f) - pil).max()) < 1e-5


def test_bfloat16_compute(folders, loaded):
    paths, refs = folders
    model, params = clip.load_clip(paths["gelu"], dtype=jnp.bfloat16)
    assert model.vision.dtype == model.text.dtype == jnp.bfloat16
    pixels = np.random.default_rng(1).normal(size=(3, IMAGE, IMAGE, 3)).astype(np.float32)
    ids = model.tokenize(PROMPTS)
    with torch.no_grad():
        t_pix = torch.from_numpy(pixels.transpose(0, 3, 1, 2))
        ref_image = refs["gelu"].get_image_features(pixel_values=t_pix).pooler_output.numpy()
        ref_text = refs["gelu"].get_text_features(input_ids=torch.from_numpy(ids).long()).pooler_output.numpy()
    image, text = jax.jit(model.image_embeds)(params, pixels), jax.jit(model.text_embeds)(params, ids)
    assert image.dtype == text.dtype == jnp.float32
    errors = (_rel_err(image, ref_image), _rel_err(text, ref_text))
    print("bf16", errors, [e / 2.0**-8 for e in errors])
    assert max(errors) < BF16_PARITY, errors


def test_gradient_through_preprocess(folders, loaded):
    """d score / d images through `preprocess` (resize, crop, normalise) and the vision tower: finite, equal to
    central finite differences, and unchanged by remat."""
    paths, _ = folders
    model, params = loaded["quick_gelu"]
    # 0.8x keeps every pixel and the resize's over/undershoot inside (0, 1): no clip kink within the FD step
    images = jnp.asarray(0.8 * _structured_images(48, 64, seed=1)[:2])
    text = model.text_embeds(params, model.tokenize(["a red circle"]))

    def score(clip_model, x):
        return jnp.sum(_unit(clip_model.image_embeds(params, clip_model.preprocess(x))) * _unit(text))

    value, grad = jax.jit(jax.value_and_grad(lambda x: score(model, x)))(images)
    assert np.all(np.isfinite(np.asarray(grad))) and float(jnp.abs(grad).max()) > 0
    remat_model, _ = clip.load_clip(paths["quick_gelu"], remat=True)
    assert remat_model.vision.remat
    remat_grad = jax.jit(jax.grad(lambda x: score(remat_model, x)))(images)
    # remat recomputes the same float32 ops (the scan runs the same layer): equal up to XLA's fusion choices, a few eps
    assert _rel_err(remat_grad, np.asarray(grad)) < 1e-5

    # Central differences along unit-l2 directions v (the steepest, g / |g|; a smooth colour field; white noise):
    # error <= delta / h + h^2 / 6 |s'''| with delta the float32 error of one evaluation of s (a cosine of unit
    # vectors, |s| <= 1: 8 eps = 1e-6; jit against eager measured 9e-8) and |s'''| <= 1e-2 along unit directions
    # (measured 5e-3 along the steepest from the error's h^2 growth at h = 0.3, 1). h = 0.03: 3.3e-5 + 1.5e-6; bound
    # 3.5e-5 absolute, against derivatives of 1e-3 (noise, smooth) to 0.1 (steepest): a missing chain factor (the 1/2 of
    # [-1, 1] -> [0, 1], 1/std, the resize's weights) misses by >= 50%. h moves a pixel by <= 2e-3: no clip kink.
    # Measured <= 2.5e-6 (h = 1e-3 would be rounding-bound at ~1e-4).
    h = 0.03
    fd_score = jax.jit(lambda x: score(model, x))
    yy, xx = np.meshgrid(np.linspace(-1, 1, images.shape[1]), np.linspace(-1, 1, images.shape[2]), indexing="ij")
    directions = [grad, jnp.asarray(np.stack([np.stack([xx, yy, xx * yy], -1), np.stack([yy, -xx, xx - yy], -1)])),
                  jax.random.normal(jax.random.PRNGKey(0), images.shape)]
    for v in directions:
        v = v / jnp.linalg.norm(v)
        fd = float(fd_score(images + h * v) - fd_score(images - h * v)) / (2 * h)
        analytic = float(jnp.sum(grad * v))
        print("fd", fd, "grad.v", analytic, "diff", fd - analytic)
        assert abs(fd - analytic) < 3.5e-5, (fd, analytic)


def test_partition_rules_fsdp_kernels(loaded):
    model, params = loaded["gelu"]
    mesh = parallel.make_mesh([("fsdp", -1)])
    specs = jax.tree_util.tree_map_with_path(
        lambda path, x: parallel.spec_for(parallel.path_str(path), x.shape, mesh, clip.PARTITION_RULES, min_fsdp_size=1),
        params)
    fsdp = jax.sharding.PartitionSpec
    assert specs["vision"]["layers_0"]["self_attn"]["q_proj"]["kernel"] == fsdp("fsdp", None)
    assert specs["vision"]["patch_embedding"]["kernel"] in (fsdp("fsdp", None), fsdp(None, "fsdp"))
    assert specs["vision"]["position_embedding"]["embedding"] == fsdp(None, "fsdp")  # [17, 32]: 32 divides
    assert specs["text"]["token_embedding"]["embedding"] != fsdp()
    for replicated in (specs["vision"]["class_embedding"], specs["vision"]["pre_layrnorm"]["scale"],
                       specs["vision"]["layers_0"]["self_attn"]["q_proj"]["bias"], specs["logit_scale"]):
        assert replicated == fsdp()
    vision_specs = jax.tree_util.tree_map_with_path(  # the tower alone, unprefixed
        lambda path, x: parallel.spec_for(parallel.path_str(path), x.shape, mesh, clip_vision.PARTITION_RULES, 1),
        params["vision"])
    assert vision_specs["position_embedding"]["embedding"] == fsdp(None, "fsdp")


def test_folder_errors(folders, tmp_path):
    paths, refs = folders
    missing = tmp_path / "nowhere"
    for call in (lambda: clip.load_clip(str(missing)), lambda: clip.check_folder(str(missing), "--reward.clip")):
        with pytest.raises(FileNotFoundError, match="no such folder") as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"--reward\.clip=.*no such folder"):
        clip.check_folder(str(missing), "--reward.clip")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(refs["gelu"].config.to_dict()))
    with pytest.raises(FileNotFoundError, match=r"--m=.*no weights.*model\.safetensors or model\.safetensors\.index"):
        clip.check_folder(str(no_weights), "--m")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        clip.load_clip(str(no_weights))

    text_only = tmp_path / "text_only"  # SD3's text_encoder/ passed where a CLIPModel is expected
    transformers.CLIPTextModelWithProjection(refs["gelu"].config.text_config).save_pretrained(text_only)
    for call in (lambda: clip.check_folder(str(text_only), "--m"), lambda: clip.load_clip(str(text_only))):
        with pytest.raises(ValueError, match="model_type='clip_text_model', not a CLIPModel") as info:
            call()
        assert "\n" not in str(info.value)

    processor_only = tmp_path / "processor_only"
    _processor(_tokenizer()).save_pretrained(processor_only)
    clip.check_folder(str(processor_only), "--p", model=False, processor=True)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        clip.check_folder(str(processor_only), "--p")
    (processor_only / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.*tokenizer.json"):
        clip.check_folder(str(processor_only), "--p", model=False, processor=True)

    # A torch-only checkpoint (PickScore_v1 on the hub): a one-line pointer to the conversion, which then loads.
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    (bin_folder / "config.json").write_text(json.dumps(refs["gelu"].config.to_dict()))
    torch.save(refs["gelu"].state_dict(), bin_folder / "pytorch_model.bin")
    _processor(_tokenizer()).save_pretrained(bin_folder)
    with pytest.raises(FileNotFoundError, match=r"python -m flowrl_jax\.models\.clip convert-bin .*bin") as info:
        clip.load_clip(str(bin_folder))
    assert "\n" not in str(info.value)
    clip.main(["convert-bin", str(bin_folder)])
    _, params = clip.load_clip(str(bin_folder))
    _, expected = clip.load_clip(paths["gelu"])
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_image_settings_from_hub_style_config():
    """A hub `preprocessor_config.json` (laion CLIP-ViT-H-14 style: int sizes, legacy keys) and the skipped steps."""
    legacy = {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
              "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.5, 0.4, 0.3],
              "image_std": [0.2, 0.3, 0.4],
              "resample": 3, "size": 224}
    settings = clip.image_settings_from_json(legacy)
    assert (settings.shortest_edge, settings.crop, settings.resample) == (224, (224, 224), "bicubic")
    assert settings.rescale == 1.0
    assert settings.mean == (0.5, 0.4, 0.3) and settings.resized_shape(512, 768) == (224, 336)
    off = clip.image_settings_from_json({**legacy, "do_resize": False, "do_center_crop": False, "do_normalize": False,
                                         "do_rescale": False})
    assert (off.shortest_edge, off.crop, off.mean, off.std, off.rescale) == (None, None, (0.0,) * 3, (1.0,) * 3, 255.0)
    x = np.full((1, 8, 8, 3), 0.5, np.float32)  # [-1, 1] -> 0.75 of white = 191.25 when not rescaled
    model = clip.CLIP(text=None, vision=None, image=off, tokenizer=None, max_length=77)
    np.testing.assert_allclose(np.asarray(model.preprocess(x)), 191.25)
    with pytest.raises(ValueError, match="resample"):
        clip.image_settings_from_json({**legacy, "resample": 0})
