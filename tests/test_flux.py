"""The FLUX.1 transformer (`models/flux.py`) equals diffusers' `FluxTransformer2DModel` at a tiny config made awkward on
purpose: an odd head count (3), a rotary split that is not even (4, 6, 6), a non-square image (4 x 6 tokens), several
single blocks, a guidance embedding; loop and scan (with remat) alike, weights loaded from the diffusers state_dict.
Its LoRA targets and their effect equal peft's with flow_grpo's FLUX LoraConfig; packing, image ids and the dynamic
shift schedule equal `FluxPipeline`'s and its scheduler's."""
import flax
import jax
import numpy as np
import pytest

from flowrl_jax.models import convert, lora
from flowrl_jax.models.flux import image_ids, pack, rope_tables, unpack
from flowrl_jax.rl.policy import Policy
from flowrl_jax.sampling import schedule

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from tests.test_sd3 import pickscore_folder  # noqa: E402,F401 (the tiny PickScore folder: a module fixture)

CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=3,
              joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
ROWS, COLS, TEXT = 4, 6, 5


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
                  img_ids=image_ids(2 * ROWS, 2 * COLS), txt_ids=np.zeros((TEXT, 3), np.float32))
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
    # float32 through 5 blocks of sums over <= 64 terms in another order (XLA vs torch): ~1e-6 of the output's scale
    # (measured 9e-7); a wrong rotary pair order or text/image order is ~7e-2 (measured)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())  # 1e-5: issue's bound, ~10x the float32 reorder error


def test_a_saved_folder_loads_without_torch_in_bf16_shards(reference, tmp_path):
    state_dict = reference[0]
    model = diffusers.FluxTransformer2DModel(**CONFIG)
    model.load_state_dict(state_dict)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "transformer", max_shard_size="20KB")  # several shards, bf16
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    ours, params = convert.load_flux(str(tmp_path))  # the pipeline folder: its transformer/ is found
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state_dict.items()}
    for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(convert.flux_from_state_dict(ours, rounded))):
        np.testing.assert_array_equal(got, want)  # the bf16 values, exactly, in the model's float32


def test_the_guidance_input_must_match_the_model(reference):
    _, x, _ = reference
    model = convert.flux_from_config({**CONFIG, "guidance_embeds": False})
    with pytest.raises(ValueError, match="no guidance embedding .*pass guidance=None"):
        model.init(jax.random.PRNGKey(0), *model.dummy_inputs()[:-1], x["guidance"][:1])
    with pytest.raises(convert.ConversionError, match="unknown keys .*guidance_embedder"):
        convert.flux_from_state_dict(model, reference[0])  # a dev checkpoint into a schnell config: one line naming it


FLOW_GRPO_FLUX_MODULES = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                          "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                          "ff_context.net.2"]  # flow_grpo scripts/train_flux.py's LoraConfig target_modules


def test_lora_targets_and_their_effect_equal_peft_with_flow_grpos_config(reference):
    peft = pytest.importorskip("peft")
    state_dict, x, _ = reference
    wrapped = diffusers.FluxTransformer2DModel(**CONFIG).eval()
    wrapped.load_state_dict(state_dict)
    wrapped = peft.get_peft_model(wrapped, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                            target_modules=FLOW_GRPO_FLUX_MODULES))
    theirs = {name.split("base_model.model.", 1)[1]: m for name, m in wrapped.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    model = convert.flux_from_config(CONFIG, lora_alpha=8.0)
    params = convert.flux_from_state_dict(model, state_dict)
    ours = lora.init_adapters(params, jax.random.PRNGKey(0), rank=4, targets=lora.FLOW_GRPO_FLUX_TARGETS)
    assert jax.tree_util.tree_structure(Policy(model, 4).init(params, jax.random.PRNGKey(0))) == jax.tree_util.tree_structure(ours)
    paths = sorted({k.rsplit("/", 1)[0] for k in flax.traverse_util.flatten_dict(ours, sep="/")})
    assert sorted(convert.flux_key(p + "/kernel")[: -len(".weight")] for p in paths) == sorted(theirs)  # the same layers
    rng, adapters = np.random.default_rng(1), {}
    with torch.no_grad():
        for path in paths:  # random A and B (B is zero at init: no effect), (alpha / r) a b about the size of W
            m = theirs[convert.flux_key(path + "/kernel")[: -len(".weight")]]
            (fan_in, _), (_, fan_out) = m.lora_A["default"].weight.shape[::-1], m.lora_B["default"].weight.shape[::-1]
            a = rng.standard_normal((fan_in, 4)).astype(np.float32) / fan_in ** 0.5
            b = rng.standard_normal((4, fan_out)).astype(np.float32) * 0.1
            m.lora_A["default"].weight.copy_(torch.from_numpy(a.T.copy()))
            m.lora_B["default"].weight.copy_(torch.from_numpy(b.T.copy()))
            adapters[path + "/a"], adapters[path + "/b"] = a, b
        expected = wrapped(**{k: torch.from_numpy(v) for k, v in x.items()}, return_dict=False)[0].numpy()
    rope = rope_tables(np.concatenate([x["txt_ids"], x["img_ids"]]), CONFIG["axes_dims_rope"])
    args = (x["hidden_states"], x["timestep"], x["encoder_hidden_states"], x["pooled_projections"], rope, x["guidance"])
    got = np.asarray(model.apply({"params": params, "lora": flax.traverse_util.unflatten_dict(adapters, sep="/")}, *args))
    base = np.asarray(model.apply({"params": params}, *args))
    assert np.abs(expected - base).max() > 100 * 1e-5 * np.abs(expected).max()  # the adapters change the output
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())  # float32 reorder as the forward's (measured 1.05e-6): 10x margin


def test_packing_ids_and_the_dynamic_shift_equal_fluxpipelines():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    latents = np.random.default_rng(2).standard_normal((2, 6, 10, 16)).astype(np.float32)  # NHWC, non-square
    nchw = torch.from_numpy(latents.transpose(0, 3, 1, 2).copy())
    packed = FluxPipeline._pack_latents(nchw, 2, 16, 6, 10).numpy()
    np.testing.assert_array_equal(np.asarray(pack(latents)), packed)  # a permutation: exact
    unpacked = FluxPipeline._unpack_latents(torch.from_numpy(packed), 6 * 8, 10 * 8, 8).numpy().transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(np.asarray(unpack(pack(latents), 6, 10)), unpacked)
    np.testing.assert_array_equal(unpacked, latents)
    np.testing.assert_array_equal(image_ids(6, 10), FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32).numpy())
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # FLUX.1's scheduler config
    for tokens, steps in ((15, 4), (1024, 28), (4096, 50)):
        mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
        assert schedule.flux_mu(tokens) == pytest.approx(mu, rel=1e-12)  # the same line through (256, 0.5), (4096, 1.15)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        ours, theirs = np.asarray(schedule.flux_sigmas(steps, mu)), scheduler.sigmas.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-7)  # both float32 roundings of float64 sigmas <= 1: <= 1 ulp of 1.0 (1.2e-7) apart


# ------------------------------------------------------------------------------------------- the pipeline
# A tiny FluxPipeline as awkward as the transformer's config above: 3 heads, rotary split (4, 6, 6), two single blocks,
# a guidance embedding; CLIP-L as CLIPTextModel (pooled, unprojected), T5 v1.1, a 16 x 24-pixel (non-square) image.
FLUX_DIT = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=3,
                joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def build_tiny_flux(folder: str):
    """A random FLUX.1-dev-like pipeline (tests/test_sd3.py's tokenizers and text encoder sizes, a 4-channel VAE) saved to
    `folder`; returns diffusers' `FluxPipeline`."""
    transformers = pytest.importorskip("transformers")
    from tests.test_sd3 import CLIP_LEN, _tokenizers, perturb, tiny_t5, tiny_vae

    torch.manual_seed(0)
    clip_tok, t5_tok = _tokenizers()
    components = dict(
        transformer=diffusers.FluxTransformer2DModel(**FLUX_DIT),
        text_encoder=transformers.CLIPTextModel(transformers.CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=16, intermediate_size=24, projection_dim=12, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=CLIP_LEN, hidden_act="quick_gelu", bos_token_id=0, eos_token_id=1,
            pad_token_id=1)),
        text_encoder_2=tiny_t5(t5_tok),
        vae=tiny_vae(4, 0.3611, 0.1159),  # FLUX's factors
    )
    perturb(components["transformer"], components["vae"])
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                          base_image_seq_len=256, max_image_seq_len=4096)  # FLUX.1's
    pipe = diffusers.FluxPipeline(scheduler=scheduler, tokenizer=clip_tok, tokenizer_2=t5_tok, **{k: m.eval() for k, m in components.items()})
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("flux"))
    return folder, build_tiny_flux(folder)


def test_encode_and_a_4_step_sample_equal_fluxpipeline(flux):
    import jax.numpy as jnp
    from flowrl_jax.worlds.sd3.flux_pipeline import load_flux_pipeline
    from tests.test_sd3 import CLIP_LEN, PROMPTS, T5_LEN, _rel_err

    folder, reference = flux
    prompts, (height, width) = PROMPTS[:2], (16, 24)  # pixels; latents 8 x 12 (the tiny VAE halves once), 4 x 6 tokens
    noise = np.random.default_rng(0).standard_normal((2, 4, 8, 12)).astype(np.float32)  # NCHW, diffusers' layout
    packed = diffusers.FluxPipeline._pack_latents(torch.from_numpy(noise), 2, 4, 8, 12)
    call = dict(prompt=prompts, height=height, width=width, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=T5_LEN)
    with torch.no_grad():
        ref_tokens, ref_pooled, _ = reference.encode_prompt(prompts, None, max_sequence_length=T5_LEN)
        ref_latents = reference(**call, latents=packed, output_type="latent").images.numpy()
        ref_images = reference(**call, latents=packed, output_type="np").images
    measured = {}
    for dtype in ("float32", "bfloat16"):
        pipe, params = load_flux_pipeline(folder, dtype=jnp.dtype(dtype), clip_max_length=CLIP_LEN, t5_max_length=T5_LEN)
        ids = jnp.asarray(pipe.tokenize(prompts))
        tokens, pooled = jax.jit(pipe.encode)(params["text"], ids)
        latents = jax.jit(pipe.sample, static_argnums=(3, 4))(params, ids, jnp.asarray(noise.transpose(0, 2, 3, 1)), 4, 1.0)
        images = np.clip(np.asarray(jax.jit(pipe.decode)(params["vae"], latents)) / 2 + 0.5, 0, 1)  # diffusers' postprocess
        measured[dtype] = dict(tokens=_rel_err(np.asarray(tokens), ref_tokens.numpy()), pooled=_rel_err(np.asarray(pooled), ref_pooled.numpy()),
                               latents=_rel_err(np.asarray(pack(latents)), ref_latents), images=_rel_err(images, ref_images))
        if dtype == "float32":
            assert tokens.shape == tuple(ref_tokens.shape) and pooled.shape == tuple(ref_pooled.shape)
            assert images.shape == ref_images.shape == (2, height, width, 3)
            assert np.abs(np.asarray(latents) - noise.transpose(0, 2, 3, 1)).max() > 0.1  # the sampler moved
    print("relative error vs FluxPipeline (float32 reference):", measured)
    # float32: each port's parity is ~1e-6 (the transformer's 9e-7 above; CLIP, T5, VAE: their tests), 4 Euler steps with
    # gain ~1 (|d sigma| <= 1): measured 4e-7 (encode) to 2.3e-6 (latents, images); a porting error is O(1)
    for name, err in measured["float32"].items():
        assert err < 1e-5, (name, measured)  # 1e-5: the bar, 4x the measured 2.3e-6
    # bfloat16 compute (float32 params): unit roundoff 2^-8 = 3.9e-3 per rounded op, through ~10 rounding stages in series
    # (CLIP, T5, 4 steps of the transformer, the VAE) whose errors do not all align: <= 10 x 3.9e-3; measured 3e-3 to 1.5e-2
    for name, err in measured["bfloat16"].items():
        assert err < 4e-2, (name, measured)  # 4e-2: 10 bf16 roundoffs in series (above), 2.6x the measured 1.5e-2


def _flux_config(folder, prompts, preset="configs/flux1_dev_pickscore.py", **fields):
    """A FLUX preset shrunk to the tiny pipeline: 16-pixel images (8 x 8 latents, 16 packed tokens), its dynamic shift."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from flowrl_jax.config_lib import load_config
    from tests.test_sd3 import CLIP_LEN, RESOLUTION, T5_LEN

    shift = float(np.exp(calculate_shift(16, 256, 4096, 0.5, 1.15)))  # FluxPipeline's mu at 16 tokens
    tiny = {"world.pipeline": folder, "world.train_prompts": prompts, "world.test_prompts": prompts, "world.resolution": RESOLUTION,
            "world.clip_max_length": CLIP_LEN, "world.t5_max_length": T5_LEN, "world.dtype": "float32", "world.param_dtype": "float32",
            "sampler.num_steps": 3, "sampler.sde_window": (0, 2), "sampler.shift": shift, "eval.shift": shift,
            "train.iterations": 2, "train.prompts_per_iteration": 2, "train.group_size": 4, "train.minibatches": 1,
            "train.lora_rank": 4, "eval.at_start": False, "eval.every": 0, "eval.num_steps": 2, "eval.batch_size": 8,
            "checkpoint.every": 1, "train.allow_rewards_without_models": True}
    return load_config(preset, **{**tiny, **fields})


def test_flow_grpo_trains_and_resumes_bit_equal_and_leapalign_trains_on_flux(flux, pickscore_folder, tmp_path):  # noqa: F811
    import json
    import shutil
    from flowrl_jax import checkpoint, main
    from tests.test_sd3 import _prompt_dataset

    folder, _ = flux
    prompts = _prompt_dataset(tmp_path)
    run = tmp_path / "grpo"
    out = main.run_job(_flux_config(folder, prompts), str(run))  # the JPEG demo reward (no PickScore folder given)
    assert out["step"] == 2
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert sum("reward" in r for r in rows) == 2 and all(r["reward_std"] > 0 for r in rows if "reward" in r)
    resumed = tmp_path / "resumed"  # killed after iteration 1: only its first checkpoint
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "2")
    main.run_job(_flux_config(folder, prompts), str(resumed))
    a, b = (checkpoint.Checkpointer(str(d / "checkpoints")) for d in (run, resumed))
    try:
        sa, sb = a.restore(2, None)[0], b.restore(2, None)[0]
    finally:
        a.close(), b.close()
    adapters = jax.tree_util.tree_leaves(sa)
    assert adapters and any(np.abs(np.asarray(x)).max() > 0 for x in adapters)
    for x, y in zip(adapters, jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # same prompts, noise and reward: bit-equal

    leap = {"world.reward_models.pickscore": pickscore_folder, "train.lora_rank": 0, "sampler.sde_window": (),
            "checkpoint.every": 0, "train.iterations": 1}  # the preset's whole-transformer fine-tune, through the VAE and PickScore
    out = main.run_job(_flux_config(folder, prompts, "configs/flux1_dev_leapalign.py", **leap), str(tmp_path / "leap"))
    rows = [json.loads(line) for line in open(tmp_path / "leap" / "metrics.jsonl") if '"reward"' in line]
    assert out["step"] == 1 and len(rows) == 1 and np.isfinite(rows[0]["loss"]) and rows[0]["grad_norm"] > 0


@pytest.mark.parametrize("preset", ["flux1_dev_pickscore", "flux1_dev_ocr", "flux1_dev_leapalign"])
def test_the_flux_presets_validate_on_every_plan_and_a_cfg_setting_is_refused(preset, pickscore_folder):  # noqa: F811
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from configs import common
    from flowrl_jax.config_lib import ConfigError, load_config
    from flowrl_jax.rl import plan

    given = {"world.pipeline": "/FLUX.1-dev", "world.train_prompts": "/prompts", "train.allow_rewards_without_models": True}
    for target in common.FLUX_MEMORY_PLANS:
        config = load_config(f"configs/{preset}.py", target, **given)
        tokens = (config.world.resolution // 16) ** 2  # VAE 8x, packed 2 x 2
        assert config.sampler.grid == "flux" and config.sampler.cfg == config.eval.cfg == 1.0
        for shift in (config.sampler.shift, config.eval.shift):  # FluxPipeline's dynamic shift at the preset's resolution
            assert shift == pytest.approx(np.exp(calculate_shift(tokens, 256, 4096, 0.5, 1.15)), rel=1e-12)
        if preset == "flux1_dev_leapalign":  # its gradient needs PickScore's weights: no model-free stand-in
            with pytest.raises(ConfigError, match="world.reward_models.pickscore"):
                plan.validate(config)
            config = load_config(f"configs/{preset}.py", target, **given, **{"world.reward_models.pickscore": pickscore_folder})
            assert config.train.lora_rank == (64 if target == "gpu" else 0)
        plan.validate(config)
    refused = {"sampler.cfg": 4.5, "eval.cfg": 3.0, "sampler.grid": "sd3", "objective.leapalign.train_cfg": 3.0}
    for key, value in refused.items():
        fields = {**given, key: value, **({"objective.name": "leapalign"} if key.startswith("objective") else {})}
        with pytest.raises(ConfigError, match=key.split(".")[-1]):
            plan.validate(load_config(f"configs/{preset}.py", "", **fields))
