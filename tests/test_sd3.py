"""The real pipeline end to end: a tiny random SD3 pipeline built with diffusers + transformers (PyTorch,
test-only), saved with `save_pretrained`, loaded by `load_sd3_pipeline` (no torch on that path), sampled
against diffusers' `StableDiffusion3Pipeline`, and trained on by the train job in the latent world."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from flowrl_jax import checkpoint, main, parallel, rewards, worlds  # noqa: E402
from flowrl_jax.data import datasets  # noqa: E402
from flowrl_jax.models import convert  # noqa: E402
from flowrl_jax.worlds.sd3.pipeline import load_sd3_pipeline  # noqa: E402
from tests.conftest import load_config  # noqa: E402

WORDS = ["a", "photo", "of", "red", "blue", "green", "cat", "dog", "dogs", "on", "the", "table", "two", "circle"]
CLIP_LEN, T5_LEN, RESOLUTION = 12, 10, 16  # tokens; pixels (the tiny VAE halves it once: 8x8 latents, 16 DiT tokens)
PROMPTS = ["a photo of a cat", "two red dogs on the table", "a blue circle", "a green dog", "the red table", "two cats"]


def _tokenizers():
    """CLIP (byte-level BPE over the words and letters) and T5 (unigram) tokenizers built offline."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in [w + "</w>" for w in WORDS] + [c + e for c in "abcdefghijklmnopqrstuvwxyz" for e in ("", "</w>")]:
        vocab.setdefault(token, len(vocab))
    clip = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_LEN)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)] + [("▁" + w, -1.0) for w in WORDS]
    t5 = transformers.T5TokenizerFast(vocab=pieces + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"], extra_ids=0)
    return clip, t5


def tiny_t5(t5_tok):
    """T5 v1.1 (gated-gelu), 2 layers of width 32: the tiny pipelines' text_encoder_3 (SD3) / text_encoder_2 (FLUX)."""
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1))


def tiny_vae(latent_channels: int, scaling_factor: float, shift_factor: float):
    """A 2-level AutoencoderKL (halves the image once) with the family's latent channels and factors."""
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, sample_size=RESOLUTION,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=scaling_factor, shift_factor=shift_factor)


def perturb(*modules):
    """Every weight moved off its init (the zero-initialised adaLN / output layers too), so every weight matters."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.add_(0.05 * torch.randn_like(p))


def build_tiny_sd3(folder: str):
    """A random SD3 pipeline (dual-attention MMDiT, CLIP quick-gelu + gelu, T5 v1.1, 16-channel VAE) saved to `folder`."""
    torch.manual_seed(0)
    clip_tok, t5_tok = _tokenizers()
    clip = dict(vocab_size=len(clip_tok), max_position_embeddings=CLIP_LEN, intermediate_size=24, num_attention_heads=2,
                num_hidden_layers=2, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    components = dict(
        transformer=diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=24,
            pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,)),
        text_encoder=transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(hidden_size=16, projection_dim=12, hidden_act="quick_gelu", **clip)),
        text_encoder_2=transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(hidden_size=8, projection_dim=12, hidden_act="gelu", **clip)),
        text_encoder_3=tiny_t5(t5_tok),
        vae=tiny_vae(16, 1.5305, 0.0609),
    )
    perturb(components["transformer"], components["vae"])
    pipe = diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), tokenizer=clip_tok, tokenizer_2=clip_tok,
        tokenizer_3=t5_tok, **{k: m.eval() for k, m in components.items()})
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sd3"))
    return folder, build_tiny_sd3(folder)


# A 4-step sample is 8 DiT evaluations (CFG) on conditionings from three text encoders, then the VAE: each port's
# parity is ~1e-6 relative (3-9 float32 eps, test_convert / test_clip_text / test_t5 / test_vae), and the Euler steps
# carry an error forward with a gain ~1 (|d sigma| <= 1, a Lipschitz-O(1) velocity at these tiny random weights). So
# ~10 sources of ~1e-6 add to ~1e-5; the project's parity bar 1e-4 (840 eps) keeps a 10x margin, and a porting error
# (wrong weight, layout, token or schedule) is O(1) of max|ref|.
PARITY = 1e-4


def _rel_err(out, ref):
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def test_sample_equals_diffusers_pipeline(sd3):
    folder, reference = sd3
    pipe, params = load_sd3_pipeline(folder, clip_max_length=CLIP_LEN, t5_max_length=T5_LEN)
    assert pipe.shift == 3.0 and pipe.latent_shape(2, RESOLUTION) == (2, 8, 8, 16)
    prompts = PROMPTS[:2]
    noise = np.random.default_rng(0).standard_normal((2, 16, 8, 8)).astype(np.float32)  # NCHW, diffusers' layout
    call = dict(prompt=prompts, height=RESOLUTION, width=RESOLUTION, num_inference_steps=4, guidance_scale=3.0,
                max_sequence_length=T5_LEN)
    with torch.no_grad():
        ref_cond = reference.encode_prompt(prompts, None, None, do_classifier_free_guidance=True, max_sequence_length=T5_LEN)
        ref_latents = reference(**call, latents=torch.from_numpy(noise), output_type="latent").images.numpy()
        ref_images = reference(**call, latents=torch.from_numpy(noise), output_type="np").images

    ids = jnp.asarray(pipe.tokenize(prompts))
    tokens, pooled = jax.jit(pipe.encode)(params["text"], ids)
    null_tokens, null_pooled = jax.jit(pipe.null_condition, static_argnums=1)(params["text"], 2)
    for ours, ref in ((tokens, ref_cond[0]), (null_tokens, ref_cond[1]), (pooled, ref_cond[2]), (null_pooled, ref_cond[3])):
        assert ours.shape == tuple(ref.shape) and _rel_err(np.asarray(ours), ref.numpy()) < PARITY
    latents = jax.jit(pipe.sample, static_argnums=(3, 4))(params, ids, jnp.asarray(noise.transpose(0, 2, 3, 1)), 4, 3.0)
    latents = np.asarray(latents).transpose(0, 3, 1, 2)
    assert np.abs(latents - noise).max() > 0.1  # the sampler moved
    assert _rel_err(latents, ref_latents) < PARITY, _rel_err(latents, ref_latents)
    images = np.asarray(jax.jit(pipe.decode)(params["vae"], jnp.asarray(latents.transpose(0, 2, 3, 1))))
    images = np.clip(images / 2 + 0.5, 0, 1)  # diffusers' postprocess to [0, 1]
    assert images.shape == ref_images.shape == (2, RESOLUTION, RESOLUTION, 3)
    assert _rel_err(images, ref_images) < PARITY, _rel_err(images, ref_images)


def test_missing_component_and_bad_weights_name_the_file(sd3, tmp_path):
    folder, _ = sd3
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError, match="has no vae/"):
        load_sd3_pipeline(str(broken))
    shutil.copytree(os.path.join(folder, "vae"), broken / "vae")
    config_path = broken / "text_encoder_2" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_size": 12}))  # the weights are width 8
    with pytest.raises(convert.ConversionError, match="text_encoder_2.*text_model.embeddings.token_embedding.weight"):
        load_sd3_pipeline(str(broken))


# ------------------------------------------------------------------------------------------- train job
def _prompt_dataset(root) -> str:
    (root / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (root / "test.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    out = str(root / "prompts")
    assert datasets.convert(str(root / "train.txt"), out, "train") == len(PROMPTS)
    datasets.convert(str(root / "test.txt"), out, "test")
    return out


def _config(folder, prompts, **fields):
    tiny = {"world.pipeline": folder, "world.train_prompts": prompts, "world.test_prompts": prompts, "world.resolution": RESOLUTION,
            "world.clip_max_length": CLIP_LEN, "world.t5_max_length": T5_LEN, "world.dtype": "float32",
            "sampler.num_steps": 3, "sampler.sde_window": (0, 2), "train.iterations": 2, "train.prompts_per_iteration": 2,
            "train.group_size": 4, "train.minibatches": 1, "train.lora_rank": 4, "eval.at_start": False, "eval.every": 0,
            "eval.num_steps": 2, "eval.batch_size": 8, "checkpoint.every": 1,
            "train.allow_rewards_without_models": True}  # eval batch: a multiple of the 8 batch shards
    return load_config("configs/sd35m_pickscore.py", **{**tiny, **fields})


# The preset's run on its JPEG demo reward, its prompt order and its resume: tests/test_after_training.py (one run shared
# with the after-training jobs' tests).


def test_text_cache_equals_encoding_on_the_fly(sd3, tmp_path):
    folder, _ = sd3
    prompts = _prompt_dataset(tmp_path)
    worlds_ = {cached: worlds.build(_config(folder, prompts, **{"world.text_cache": cached})) for cached in (False, True)}
    loaded = {cached: w.load()[1] for cached, w in worlds_.items()}
    assert set(loaded[True]["text"]) == {"tokens", "pooled"} and "t5" in loaded[False]["text"]  # the encoders are dropped
    assert loaded[True]["text"]["tokens"].shape == (len(PROMPTS) + 1, CLIP_LEN + T5_LEN, 32)  # 6 prompts + ""
    rows = [{"prompt": p} for p in (PROMPTS[4], PROMPTS[0], PROMPTS[4])]
    out = {}
    for cached, world in worlds_.items():
        ids, mask = world.tokenize(rows)
        assert ids.shape == ((3, 1) if cached else (3, 2 * CLIP_LEN + T5_LEN))
        out[cached] = jax.jit(world.encode)(loaded[cached], ids, mask) + jax.jit(world.null_condition, static_argnums=1)(loaded[cached], 3)
    # The same float32 encoders on the same ids; only the batch differs (cache batches of 32 vs these 3 rows), which may
    # reorder a matmul's sums over K <= 48 terms: <= 48 eps ~ 6e-6 relative; 1e-5 bounds it, a wrong row is O(1).
    for a, b in zip(out[True], out[False]):
        assert a.shape == b.shape and _rel_err(np.asarray(a), np.asarray(b)) < 1e-5
    with pytest.raises(ValueError, match="not in the text cache"):
        worlds_[True].tokenize([{"prompt": "a prompt of neither set"}])


def test_decoding_in_row_chunks_equals_decoding_at_once(sd3, tmp_path):
    """`train.rollout_chunk` also cuts the VAE decode of a rollout into row chunks spanning every device (the memory
    plan's third knob): the images are the decoder's on the same latents, rows in their places."""
    folder, _ = sd3
    prompts = _prompt_dataset(tmp_path)
    world = worlds.build(_config(folder, prompts, **{"train.rollout_chunk": 8}))
    params = world.load()[1]
    mesh = world.facts.mesh
    latents = parallel.shard_batch(np.asarray(jax.random.normal(jax.random.PRNGKey(0), world.latent_shape(32))), mesh)
    vae = jax.device_put(params["vae"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    chunked = np.asarray(world.decode({"vae": vae}, latents))
    whole = np.asarray(jax.jit(world.pipe.decode)(vae, latents))
    # the same float32 decoder on the same rows, batch 8 (one row per device) vs 32: a matmul's sums may be blocked
    # otherwise (K <= 9 x 64 terms, <= 576 eps ~ 7e-5 relative at worst); a row out of place is O(1)
    assert chunked.shape == whole.shape == (32, RESOLUTION, RESOLUTION, 3) and _rel_err(chunked, whole) < 1e-4
    # stepwise credit's completions [B, m, h, w, C]: the leading axes fold into the batch, rows in their places
    stacked = np.asarray(world.decode({"vae": vae}, np.asarray(latents).reshape((8, 4) + latents.shape[1:])))
    assert stacked.shape == (8, 4, RESOLUTION, RESOLUTION, 3) and _rel_err(stacked.reshape(whole.shape), whole) < 1e-4  # as above


def test_loading_places_every_weight_shard_by_shard(sd3, tmp_path, monkeypatch):
    """The pipeline's weights are read into host memory (numpy, in `world.param_dtype`: bf16 frozen weights here) and
    placed by the partition rules with each device given only its own pieces: no device ever holds a whole tensor
    that the rules shard. Checked on the arrays' shardings: every piece handed to a device, and every live array."""
    folder, _ = sd3
    config = _config(folder, _prompt_dataset(tmp_path), **{"min_fsdp_size": 64, "world.param_dtype": "bfloat16",
                                                           "world.text_cache": True})  # the cache encodes on placed encoders
    pieces, make = [], jax.make_array_from_callback

    def recording(shape, sharding, callback, *args, **kwargs):  # parallel.put_global's only way onto a device
        def piece(index):
            data = callback(index)
            pieces.append((tuple(shape), np.shape(data), sharding.is_fully_replicated))
            return data
        return make(shape, sharding, piece, *args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_callback", recording)
    world = worlds.build(config)
    _, host = world.load()
    assert all(isinstance(a, np.ndarray) for a in jax.tree_util.tree_leaves(host))  # host memory, no device yet
    assert {a.dtype for a in jax.tree_util.tree_leaves((host["dit"], host["vae"]))} == {np.dtype(jnp.bfloat16)}
    mesh = parallel.make_mesh(config.mesh)
    shardings = parallel.tree_shardings(host, mesh, config.partition_rules, config.min_fsdp_size)
    placed = parallel.put_global(host, shardings)  # as rl/state.place_frozen places the frozen tree
    sharded = [(a, s) for a, s in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(shardings)) if not s.is_fully_replicated]
    assert len(sharded) >= 20  # the DiT's and the VAE's kernels at min_fsdp_size 64
    for a, s in sharded:
        assert a.sharding == s and len(a.addressable_shards) == 8
        assert all(x.data.shape == s.shard_shape(a.shape) and x.data.size * 8 == a.size for x in a.addressable_shards)
    # every piece any device was given during loading (the text encoders for the cache included) is whole only if replicated
    assert pieces and all(p != full or replicated for full, p, replicated in pieces)
    assert sum(p != full for full, p, _ in pieces) >= 8 * len(sharded)
    # no whole copy of a sharded tensor alive on one device (a piece of a placed array may have the same shape: excluded)
    whole = {a.shape for a, _ in sharded}
    pieces_held = {x.data.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(placed) for x in a.addressable_shards}
    strays = [x for x in jax.live_arrays() if x.shape in whole and len(x.sharding.device_set) == 1
              and x.unsafe_buffer_pointer() not in pieces_held]
    assert not strays, [(x.shape, x.sharding) for x in strays[:3]]


@pytest.fixture(scope="module")
def pickscore_folder(tmp_path_factory):
    """A tiny random CLIPModel + processor folder (tests/test_clip.py's builders) standing in for PickScore_v1."""
    from tests.test_clip import _processor, _reference, _tokenizer

    folder = tmp_path_factory.mktemp("pickscore")
    tokenizer = _tokenizer()
    _reference("gelu", legacy_eos=False, vocab_size=len(tokenizer)).save_pretrained(folder)
    _processor(tokenizer).save_pretrained(folder)
    return str(folder)


def test_pickscore_of_decoded_latents_has_the_finite_difference_gradient(sd3, pickscore_folder, tmp_path):
    """The latent world's reward model, pickscore(decode(latents)): `jax.grad` w.r.t. the latents against central
    differences along random unit directions (float32)."""
    folder, _ = sd3
    config = _config(folder, _prompt_dataset(tmp_path), **{"train.rewards": (("pickscore", 1.0),),
                                                           "world.reward_models.pickscore": pickscore_folder})
    world = worlds.build(config)
    world.load()
    apply, params, tokenize = world.reward_model()
    ids, mask = tokenize([{"prompt": p} for p in PROMPTS[:2]])
    latents = jax.random.normal(jax.random.PRNGKey(0), world.latent_shape(2))
    f = jax.jit(lambda x: apply(params, x, ids, mask).sum())
    grad = np.asarray(jax.grad(lambda x: apply(params, x, ids, mask).sum())(latents))
    assert np.isfinite(grad).all() and np.abs(grad).max() > 0
    directions = [grad] + [np.array(jax.random.normal(jax.random.PRNGKey(10 + i), latents.shape)) for i in range(2)]
    for i, v in enumerate(directions):  # along the gradient (derivative |grad|, 1.16 here), then two random directions
        v = v / np.linalg.norm(v)
        h = 1e-2
        fd = (float(f(latents + h * v)) - float(f(latents - h * v))) / (2 * h)
        # f is two PickScores, |f| <= 2 x 100 / 26 = 7.7; evaluated in float32 through the VAE decoder and both CLIP towers
        # it carries a relative error ~1e-6 (each port's parity is ~4e-7), so the difference quotient errs by up to
        # 2 x 1e-6 x 7.7 / (2h) = 7.7e-4; the truncation error h^2/6 |f^(3)| is ~1e-5 for these smooth maps (GELU, softmax,
        # bicubic; the +-1 clips are not reached by these decodes). Bound 2e-3; measured 5.7e-5 to 4.0e-4. Along the gradient
        # that is 0.2% of the derivative: a wrong chain rule (a missing factor, a dropped branch) is O(1).
        assert abs(fd - float(np.sum(grad * v))) < 2e-3, (i, fd, float(np.sum(grad * v)))


def test_train_on_pickscore_flow_grpo_resumes_bit_equal_and_leapalign_and_spatial_credit_run(sd3, pickscore_folder, tmp_path):
    folder, _ = sd3
    prompts = _prompt_dataset(tmp_path)
    fields = {"train.rewards": (("pickscore", 1.0),), "world.reward_models.pickscore": pickscore_folder}
    run = tmp_path / "grpo"
    out = main.run_job(_config(folder, prompts, **fields), str(run))
    assert out["step"] == 2
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train_rows = [r for r in rows if "reward" in r]
    assert len(train_rows) == 2 and all("reward/pickscore" in r and r["reward_std"] > 0 for r in train_rows)
    assert "eval/pickscore" in rows[-1] or any("eval/pickscore" in r for r in rows)  # each component logged, eval too
    resumed = tmp_path / "resumed"  # killed after iteration 1: only its first checkpoint
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "2")
    main.run_job(_config(folder, prompts, **fields), str(resumed))
    a, b = (checkpoint.Checkpointer(str(d / "checkpoints")) for d in (run, resumed))
    try:
        sa, sb = a.restore(2, None)[0], b.restore(2, None)[0]
    finally:
        a.close(), b.close()
    for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # same prompts, noise and reward: bit-equal

    leap = {**fields, "objective.name": "leapalign", "sampler.kind": "ode", "sampler.sde_window": (),
            "sampler.same_noise_per_group": False, "eval.every": 0, "checkpoint.every": 0}
    out = main.run_job(_config(folder, prompts, **leap), str(tmp_path / "leap"))
    rows = [json.loads(line) for line in open(tmp_path / "leap" / "metrics.jsonl") if '"reward"' in line]
    assert out["step"] == 2 and len(rows) == 2 and all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)

    spatial = {**fields, "credit.names": ("uniform", "spatial"), "objective.grpo.ratio": "token", "train.iterations": 1,
               "eval.every": 0, "checkpoint.every": 0}  # spatial credit's map: the reward's gradient in the latents' tokens
    out = main.run_job(_config(folder, prompts, **spatial), str(tmp_path / "spatial"))
    assert out["step"] == 1 and os.path.isfile(tmp_path / "spatial" / "credit_maps_000001.png")


def test_eval_is_sharded_over_the_batch_axes_and_equals_the_unsharded_table(sd3, pickscore_folder, tmp_path):
    """The latent world's eval splits every batch over the mesh's batch axes (ids, noise and images read back sharded),
    scores each row once where it lies, and drops the padding; its table equals the same samples computed unsharded on
    one device (2 test prompts x 5 samples = 10 rows: a full batch of 8 and one of 2 padded to 8)."""
    folder, _ = sd3
    config = _config(folder, _prompt_dataset(tmp_path), **{"train.rewards": (("pickscore", 1.0),), "eval.num_steps": 1,
                                                           "world.reward_models.pickscore": pickscore_folder, "eval.samples_per_prompt": 5})
    world = worlds.build(config)
    _, host = world.load()
    frozen = world.place(host)
    params = {k: frozen[k] for k in ("dit", "text", "vae")}
    rows = [p for p in world.test_prompts for _ in range(5)]
    ids, noise = world.eval_inputs(rows[:8], jax.random.PRNGKey(5))
    images = world.eval_batch(params, ids, noise)
    batch = parallel.batch_sharding(world.facts.mesh)
    assert parallel.batch_shards(world.facts.mesh) == 8
    for x in (ids, noise, images):
        assert x.sharding.is_equivalent_to(batch, x.ndim), x.sharding
    table = world.evaluate(frozen["dit"], frozen, 0, str(tmp_path)).entry["table"]["test"]
    assert table["n"] == 10 and os.path.isfile(tmp_path / "eval_000000.png")

    e, pipe, reward = config.eval, world.pipe, rewards.build((("pickscore", 1.0),), config.world.reward_models)
    sample = jax.jit(lambda p, i, n: pipe.decode(p["vae"], pipe.sample_from(p["dit"], world.encode(p, i, None),
                                                                               world.null_condition(p, i.shape[0]), n, e.num_steps, e.cfg, e.shift)))
    scores = []
    for k, start in enumerate(range(0, 10, 8)):  # the unsharded reference: one device, the same rows and noise
        chunk = rows[start : start + 8]
        padded = chunk + [chunk[-1]] * (8 - len(chunk))
        noise_k = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(e.noise_seed), k), world.latent_shape(8))
        out = np.asarray(sample(jax.device_get(host), jnp.asarray(world.tokenize(padded)[0]), noise_k))
        scores.append(reward(out, padded)[0][: len(chunk)])
    # The same float32 computation per row, with the batch split over 8 devices instead of one: XLA may block the matmuls
    # differently, a few ulp per op through one ODE step, the VAE and both CLIP towers; the ports' parity against PyTorch
    # is ~4e-7 relative (test_clip, test_vae), so 1e-4 of a PickScore (|r| <= 100/26) is ~100x that. A row scored twice,
    # dropped, or given another row's noise moves the mean by O(0.1).
    np.testing.assert_allclose(table["reward"], np.mean(np.concatenate(scores)), rtol=1e-4, atol=1e-5)  # ~100x float32 parity, above
