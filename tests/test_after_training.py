"""After training, proven with the reference libraries (diffusers, peft; test-only): a tiny SD3 LoRA run's export loads
in diffusers three ways and samples what the JAX pipeline samples; a flow_grpo PEFT adapter and a diffusers LoRA file
import with their loaders' velocity; the sample and evaluate jobs on the tiny pipeline and on the shapes world's model."""
import json
import os
import shlex
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from flowrl_jax import checkpoint, main  # noqa: E402
from flowrl_jax.data import datasets  # noqa: E402
from flowrl_jax.jobs import train  # noqa: E402
from flowrl_jax.models import lora, lora_files  # noqa: E402
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib, trained  # noqa: E402
from flowrl_jax.worlds.sd3.pipeline import load_sd3_pipeline  # noqa: E402
from tests.conftest import load_config  # noqa: E402
from tests.test_sd3 import CLIP_LEN, PARITY, PROMPTS, RESOLUTION, T5_LEN, _config, _prompt_dataset, _rel_err, build_tiny_sd3  # noqa: E402

FLOW_GRPO_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
                     "attn.to_q", "attn.to_v"]  # flow_grpo's train_sd3.py LoraConfig (r=32, lora_alpha=64, gaussian)


def _recording_prompts(monkeypatch, seen: list) -> None:
    """The train loop's own `sample_prompts` phase, each iteration's prompt rows appended to `seen`."""
    sample_prompts = train.sample_prompts

    def recording(job, state, it):
        batch = sample_prompts(job, state, it)
        seen.append([row["prompt"] for row in batch.prompts_local])
        return batch

    monkeypatch.setattr(train, "sample_prompts", recording)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-iteration LoRA run (rank 4) of the SD3.5-M preset on the tiny pipeline (its JPEG demo reward: the preset's
    PickScore has no weights here), at a learning rate that moves the adapters far from their zero start (so that a LoRA
    dropped or mis-scaled anywhere shows), with a checkpoint per iteration, its eval at step 2 and its prompts recorded."""
    root = tmp_path_factory.mktemp("after")
    folder = str(root / "sd3")
    reference = build_tiny_sd3(folder)
    prompts = _prompt_dataset(root)
    fields, seen = {"train.lr": 3e-2}, []
    with pytest.MonkeyPatch.context() as monkeypatch:
        _recording_prompts(monkeypatch, seen)
        out = main.run_job(_config(folder, prompts, **fields), str(root / "run"))
    return {"folder": folder, "reference": reference, "prompts": prompts, "workdir": str(root / "run"), "fields": fields,
            "out": out, "seen": seen}


def test_the_run_resumes_in_its_prompt_order_bit_equal(run, tmp_path, monkeypatch):
    """The run writes what it should (eval at its end, JPEG rewards: minus kilobytes), reads its prompts per process in the
    reader's order, and a resume from step 1 continues that order and ends bit-equal."""
    out, workdir = run["out"], tmp_path / "resumed"
    assert out["step"] == 2 and [e["step"] for e in out["evals"]] == [2] and os.path.isfile(os.path.join(run["workdir"], "eval_000002.png"))
    rows = [json.loads(line) for line in open(os.path.join(run["workdir"], "metrics.jsonl"))]
    assert [r["reward"] < 0 for r in rows if "reward" in r] == [True, True]  # minus JPEG kilobytes
    assert len(run["seen"]) == 2 and all(len(b) == 2 * 4 for b in run["seen"])
    reader = datasets.PromptReader(datasets.PromptDataset(run["prompts"], "train"), 2, seed=0)
    assert [b[::4] for b in run["seen"]] == [[p["prompt"] for p in next(reader)] for _ in range(2)]
    assert json.load(open(os.path.join(run["workdir"], "run.json")))["config"]["train"]["lr"] == 3e-2  # the model card's source

    shutil.copytree(run["workdir"], workdir)  # the run as if killed after iteration 1: only its first checkpoint
    shutil.rmtree(workdir / "checkpoints" / "2")
    seen = []
    _recording_prompts(monkeypatch, seen)
    main.run_job(_job(run, "train"), str(workdir))
    assert seen == run["seen"][1:]  # the same prompt order
    a, b = (checkpoint.Checkpointer(os.path.join(d, "checkpoints")) for d in (run["workdir"], str(workdir)))
    try:
        sa, sb = a.restore(2, None)[0], b.restore(2, None)[0]
    finally:
        a.close(), b.close()
    for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # same prompts, same noise: bit-equal


def _job(run, job, **fields):
    return _config(run["folder"], run["prompts"], **{**run["fields"], "job": job, **fields})


def _diffusers_latents(pipe, transformer, noise):
    pipe.transformer = transformer
    with torch.no_grad():
        return pipe(prompt=PROMPTS[:2], height=RESOLUTION, width=RESOLUTION, num_inference_steps=3, guidance_scale=3.0,
                    max_sequence_length=T5_LEN, latents=torch.from_numpy(noise), output_type="latent").images.numpy()


def test_export_loads_in_diffusers_as_lora_peft_and_merged_folder_and_samples_what_jax_samples(run, tmp_path):
    out = main.run_job(_job(run, "export", **{"export.formats": "lora,peft,merged", "export.dtype": "float32",
                                                  "export.max_shard_gb": 4e-5, "export.out": str(tmp_path)}), run["workdir"])
    assert out["step"] == 2 and sorted(out["folders"]) == ["lora", "merged", "peft"]
    shards = sorted(n for n in os.listdir(tmp_path / "merged") if n.endswith(".safetensors"))
    assert len(shards) >= 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")  # 130 kB in shards of <= 43 kB
    card = open(tmp_path / "lora" / "README.md").read()
    assert "Steps trained**: 2" in card and "load_lora_weights" in card and "## Last eval (step 2)" in card
    peft_config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert peft_config["r"] == 4 and peft_config["lora_alpha"] == 64 and sorted(peft_config["target_modules"]) == FLOW_GRPO_TARGETS

    # The JAX pipeline's sample of the exported policy (the EMA at step 2), 3 ODE steps at CFG 3
    policy = trained.load(_job(run, "export"), run["workdir"])
    pipe, params = load_sd3_pipeline(run["folder"], clip_max_length=CLIP_LEN, t5_max_length=T5_LEN)
    noise = np.random.default_rng(0).standard_normal((2, 16, 8, 8)).astype(np.float32)  # NCHW, diffusers' layout
    sample = jax.jit(pipe.sample, static_argnums=(3, 4))
    ids = jnp.asarray(pipe.tokenize(PROMPTS[:2]))
    ours = np.asarray(sample({**params, "dit": policy.dit_params()}, ids, jnp.asarray(noise.transpose(0, 2, 3, 1)), 3, 3.0)).transpose(0, 3, 1, 2)

    reference = diffusers.StableDiffusion3Pipeline.from_pretrained(run["folder"])
    fresh = lambda: diffusers.SD3Transformer2DModel.from_pretrained(run["folder"], subfolder="transformer")  # noqa: E731
    base = _diffusers_latents(reference, fresh(), noise)
    reference.transformer = fresh()
    reference.load_lora_weights(str(tmp_path / "lora"))  # the documented four lines: pipe.load_lora_weights(folder)
    loaded = {"lora": _diffusers_latents(reference, reference.transformer, noise),
              "peft": _diffusers_latents(reference, peft.PeftModel.from_pretrained(fresh(), str(tmp_path / "peft")), noise),
              "merged": _diffusers_latents(reference, diffusers.SD3Transformer2DModel.from_pretrained(str(tmp_path / "merged")), noise)}
    # Each is the same float32 model computed by diffusers (the LoRA unmerged, x W + s (x A) B, for lora and peft) and by
    # the port (merged), so they differ by summation order only; the port's parity bound (tests/test_sd3.py PARITY, 1e-4
    # of max|ref| over a 3-4 step sample, ~100x the measured error) holds for them. The LoRA's own effect is far above it:
    # an export that dropped or mis-scaled it (alpha / r twice, or not at all) is off by that effect, checked here to be
    # >= 100 x PARITY.
    assert _rel_err(ours, base) > 100 * PARITY, _rel_err(ours, base)
    for name, latents in loaded.items():
        assert _rel_err(latents, ours) < PARITY, (name, _rel_err(latents, ours))

    # and every export reads back as the adapters it was written from (float32 files: exact up to alpha / r folding)
    for fmt in ("lora", "peft"):
        adapters, alpha = lora_files.read_lora(str(tmp_path / fmt), params["dit"])
        merged = lora.merge(params["dit"], adapters, alpha)
        for x, y in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(policy.dit_params())):
            np.testing.assert_allclose(x, y, rtol=0, atol=4 * np.finfo(np.float32).eps * max(1.0, np.abs(y).max()))  # W + (a_r/r) a (s b), s = alpha/a_r folded in float32: a product rounded another way, <= 4 eps of |W|


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, 16, 8, 8)).astype(np.float32), np.array([0.3, 0.8], np.float32),
            rng.standard_normal((2, 7, 32)).astype(np.float32), rng.standard_normal((2, 24)).astype(np.float32))


def _torch_velocity(model, x, t, txt, pooled):
    with torch.no_grad():
        return model(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(txt),
                     pooled_projections=torch.from_numpy(pooled), timestep=torch.from_numpy(1000 * t)).sample.numpy()


def test_a_flow_grpo_peft_adapter_and_a_diffusers_lora_file_import_with_their_loaders_velocity(run, tmp_path):
    pipe, params = load_sd3_pipeline(run["folder"], clip_max_length=CLIP_LEN, t5_max_length=T5_LEN)
    torch.manual_seed(1)
    transformer = diffusers.SD3Transformer2DModel.from_pretrained(run["folder"], subfolder="transformer")
    model = peft.get_peft_model(transformer, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                             target_modules=FLOW_GRPO_TARGETS))
    with torch.no_grad():  # a trained adapter: lora_B off its zero init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(tmp_path / "flow_grpo"))  # flow_grpo's save: PeftModel.save_pretrained
    layers = {k.removeprefix("base_model.model."): v for k, v in peft.get_peft_model_state_dict(model).items()}  # add_adapter's names
    diffusers.StableDiffusion3Pipeline.save_lora_weights(str(tmp_path / "diffusers"), transformer_lora_layers=layers)  # diffusers' scripts
    inputs = _inputs()
    x, t, txt, pooled = inputs
    velocity = jax.jit(lambda p: pipe.dit.apply({"params": p}, jnp.asarray(x.transpose(0, 2, 3, 1)), t, txt, pooled))
    base = np.asarray(velocity(params["dit"])).transpose(0, 3, 1, 2)

    adapters, alpha = lora_files.read_lora(str(tmp_path / "flow_grpo"), params["dit"])
    ours_default = lora.init_adapters(params["dit"], jax.random.PRNGKey(0), rank=4)  # our targets: flow_grpo's eight
    assert alpha == 8 and lora_files.rank_of(adapters) == 4
    assert jax.tree_util.tree_structure(adapters) == jax.tree_util.tree_structure(ours_default)  # 8 + 7 (the last block has no to_add_out)
    ours = np.asarray(velocity(lora.merge(params["dit"], adapters, alpha))).transpose(0, 3, 1, 2)
    ref = _torch_velocity(model, *inputs)
    # the port's parity bar (PARITY, tests/test_convert.py: ~100x the measured 3-9 eps), the LoRA 100x above it
    assert _rel_err(ref, base) > 100 * PARITY and _rel_err(ours, ref) < PARITY, (_rel_err(ref, base), _rel_err(ours, ref))

    # a run started from it (policy.lora): its step-0 adapters, rescaled to the DiT's lora_alpha = 64, applied unmerged in
    # the forward pass (the `lora` collection, as the update differentiates it) give peft's velocity again
    config = _job(run, "train", **{"policy.lora": str(tmp_path / "flow_grpo")})
    plan = plan_lib.make_plan(config)
    dit, host = plan.world.load()
    _, frozen, state = programs_lib.build(plan, dit, host)
    unmerged = jax.jit(lambda p, a: dit.apply({"params": p, "lora": a}, jnp.asarray(x.transpose(0, 2, 3, 1)), t, txt, pooled))
    for tree in (state.params, state.ema):
        out = np.asarray(unmerged(frozen["dit"], tree)).transpose(0, 3, 1, 2)
        assert _rel_err(out, ref) < PARITY, _rel_err(out, ref)
    with pytest.raises(main.ConfigError, match="pass --config.train.lora_rank=4"):
        programs_lib.build(plan_lib.make_plan(_job(run, "train", **{"policy.lora": str(tmp_path / "flow_grpo"), "train.lora_rank": 8})), dit, host)

    # a diffusers LoRA file of the same weights, without metadata: diffusers (and we) take lora_alpha = r, not the 8 above
    adapters, alpha = lora_files.read_lora(str(tmp_path / "diffusers"), params["dit"])
    assert alpha == 4
    fresh = diffusers.SD3Transformer2DModel.from_pretrained(run["folder"], subfolder="transformer")
    fresh.load_lora_adapter(str(tmp_path / "diffusers" / lora_files.DIFFUSERS_WEIGHTS), prefix="transformer")
    ref_file = _torch_velocity(fresh, *inputs)
    ours = np.asarray(velocity(lora.merge(params["dit"], adapters, alpha))).transpose(0, 3, 1, 2)
    assert _rel_err(ref_file, ref) > 100 * PARITY and _rel_err(ours, ref_file) < PARITY, (_rel_err(ref_file, ref), _rel_err(ours, ref_file))

    # and the imported LoRA is a policy: sampled through the job (with Flow-GRPO's SDE kernel), from the same field
    out = main.run_job(_job(run, "sample", **{"policy.lora": str(tmp_path / "flow_grpo"), "sample.prompt": PROMPTS[0],
                                                  "sample.samples_per_prompt": 1, "sample.num_steps": 2, "sample.kind": "sde"}),
                       str(tmp_path / "w"))
    assert out["source"] == f"the LoRA {tmp_path / 'flow_grpo'}" and out["out"] == str(tmp_path / "w" / "samples" / "lora_flow_grpo")
    sidecar = json.load(open(os.path.join(out["out"], "00000.json")))
    assert sidecar["kind"] == "sde" and sidecar["noise_level"] == 0.7 and os.path.isfile(os.path.join(out["out"], "00000.png"))


def test_a_lora_of_another_model_or_layout_is_a_clear_error(run, tmp_path):
    _, params = load_sd3_pipeline(run["folder"], clip_max_length=CLIP_LEN, t5_max_length=T5_LEN)
    from flowrl_jax.models import convert

    convert.write_safetensors(str(tmp_path / "kohya.safetensors"), {"lora_unet_x.lora_down.weight": np.zeros((4, 16), np.float32)})
    with pytest.raises(lora_files.LoraFileError, match="not a PEFT / diffusers LoRA key"):
        lora_files.read_lora(str(tmp_path / "kohya.safetensors"), params["dit"])
    convert.write_safetensors(str(tmp_path / "other.safetensors"), {
        "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": np.zeros((4, 16), np.float32),
        "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": np.zeros((16, 4), np.float32)})
    with pytest.raises(lora_files.LoraFileError, match="trained on another model"):
        lora_files.read_lora(str(tmp_path / "other.safetensors"), params["dit"])
    with pytest.raises(FileNotFoundError, match="PEFT adapter folder"):
        lora_files.read_lora(str(tmp_path / "missing"), params["dit"])


def test_sample_job_writes_pngs_with_their_seeds_and_a_seed_gives_its_image_in_any_batch(run, tmp_path):
    (tmp_path / "prompts.txt").write_text(f"{PROMPTS[0]}\n{PROMPTS[1]}\n")
    fields = {"sample.prompts": str(tmp_path / "prompts.txt"), "sample.samples_per_prompt": 3, "sample.seed": 10,
              "sample.num_steps": 2, "sample.out": str(tmp_path / "all")}
    out = main.run_job(_job(run, "sample", **fields), run["workdir"])
    assert out["images"] == 6 and out["source"].startswith("step 2 (EMA)")
    sidecar = json.load(open(tmp_path / "all" / "00004.json"))
    assert sidecar["prompt"] == PROMPTS[1] and sidecar["seed"] == 14 and sidecar["num_steps"] == 2 and sidecar["kind"] == "ode"
    assert os.path.isfile(tmp_path / "all" / "grid.png")
    one = main.run_job(_job(run, "sample", **{"sample.prompt": PROMPTS[1], "sample.samples_per_prompt": 1, "sample.seed": 14,
                                                  "sample.num_steps": 2, "sample.out": str(tmp_path / "one")}), run["workdir"])
    assert one["images"] == 1
    png = lambda path: np.asarray(Image.open(path), np.int16)  # noqa: E731
    # the same row's float32 computation in another batch (1 row + 7 padding copies vs 6 rows + 2): XLA may block its
    # reductions differently, a few ulp, which can move a pixel's uint8 rounding by at most one level
    assert np.abs(png(tmp_path / "one" / "00000.png") - png(tmp_path / "all" / "00004.png")).max() <= 1
    assert np.abs(png(tmp_path / "all" / "00003.png") - png(tmp_path / "all" / "00004.png")).max() > 10  # another seed
    with pytest.raises(main.ConfigError, match="sample.prompt"):
        main.run_job(_job(run, "sample"), run["workdir"])


def test_evaluate_job_equals_the_train_loops_eval_of_the_checkpoint_and_splits_categories(run, tmp_path):
    out = main.run_job(_job(run, "evaluate", **{"evaluate.out": str(tmp_path / "e")}), run["workdir"])
    logged = [e for e in json.load(open(os.path.join(run["workdir"], "eval.json")))["evals"] if e["step"] == 2]
    # the same programs (the world's evaluate, the LoRA folded in by lora.merge on the same placed arrays) on the same
    # weights, prompts and noise: deterministic, so the table is the train loop's exactly
    assert out["step"] == 2 and out["table"] == logged[0]["table"]
    assert json.load(open(tmp_path / "e" / "evaluate.json"))["table"] == out["table"]
    assert os.path.isfile(tmp_path / "e" / "eval_000002.png")

    rows = [{"prompt": PROMPTS[0], "tag": "single"}, {"prompt": PROMPTS[1], "tag": "counting"}, {"prompt": PROMPTS[2], "tag": "single"}]
    (tmp_path / "geneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = main.run_job(_job(run, "evaluate", **{"evaluate.prompts": str(tmp_path / "geneval.jsonl"), "eval.samples_per_prompt": 2,
                                                    "evaluate.out": str(tmp_path / "g")}), run["workdir"])
    table = out["table"]
    assert list(table) == ["test", "single", "counting"] and [table[r]["n"] for r in table] == [6, 4, 2]
    # the overall mean is the rows' mean: a sample-weighted mean of the categories' means (float64 means of float32 values)
    assert table["test"]["reward"] == pytest.approx((4 * table["single"]["reward"] + 2 * table["counting"]["reward"]) / 6, rel=1e-6)


def _readme_command(job: str) -> list[str]:
    """The README's after-training command of `job`, as argv (after `python -m flowrl_jax.main`)."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    lines = [line for line in text.splitlines() if line.startswith("python -m flowrl_jax.main") and f"--config.job={job}" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[3:]


def _run_argv(argv: list[str], workdir: str):
    """`main`'s flags, in process: --config FILE, --workdir (replaced by `workdir`), --config.a.b=value (typed as the
    field is)."""
    args = dict(a.split("=", 1) if "=" in a else (a, None) for a in argv)
    config_file = argv[argv.index("--config") + 1]
    config = load_config(config_file)
    for key, value in args.items():
        if key.startswith("--config."):
            *parents, leaf = key[len("--config."):].split(".")
            node = config
            for part in parents:
                node = node[part]
            node[leaf] = type(node[leaf])(value)
    return main.run_job(config, workdir)


def test_the_readmes_sample_and_evaluate_commands_run_on_the_shapes_worlds_shipped_model(tmp_path):
    """Before any training the quickstart's workdir has no checkpoint: the commands sample and evaluate the shipped base."""
    out = _run_argv(_readme_command("sample"), str(tmp_path))
    assert out["source"] == "the base" and out["out"] == str(tmp_path / "samples" / "base")
    assert sorted(os.listdir(out["out"]))[:2] == ["00000.json", "00000.png"] and os.path.isfile(os.path.join(out["out"], "grid.png"))
    assert json.load(open(os.path.join(out["out"], "00003.json")))["seed"] == 3
    from flowrl_jax.data import shapes

    # on one test prompt per category, not the 210 of test.jsonl (minutes with the suite's XLA optimizations off)
    rows = [next(q for q in shapes.load_prompts("test") if q["category"] == c) for c in shapes.CATEGORIES]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _run_argv(_readme_command("evaluate") + [f"--config.evaluate.prompts={tmp_path / 'test.jsonl'}", "--config.eval.batch_size=8"],
                    str(tmp_path))
    assert set(out["table"]) == {"overall", *shapes.CATEGORIES} and all(out["table"][c]["n"] == 1 for c in shapes.CATEGORIES)
    assert os.path.isfile(tmp_path / "evaluate" / "base" / "evaluate.json")


def test_a_bfloat16_merged_folder_loads_in_diffusers_as_the_rounded_weights(run, tmp_path):
    """`export.dtype=bfloat16` (the default): diffusers reads every tensor as our float32 value rounded to bfloat16
    (round to nearest even, the one rounding both libraries use: compared exactly)."""
    from flowrl_jax.models import convert

    policy = trained.load(_job(run, "export"), run["workdir"])
    convert.save_diffusers(str(tmp_path), policy.dit, policy.dit_params(), jnp.bfloat16)
    theirs = diffusers.SD3Transformer2DModel.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16).state_dict()
    ours = convert.to_state_dict(policy.dit, policy.dit_params())
    assert set(theirs) == set(ours)
    for key, value in ours.items():
        np.testing.assert_array_equal(theirs[key].float().numpy(), torch.from_numpy(value).bfloat16().float().numpy(), err_msg=key)
