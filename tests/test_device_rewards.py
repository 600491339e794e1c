"""The device rewards (`rewards/device.py`) against flow_grpo's formulas computed in PyTorch by transformers, on a tiny
random `CLIPModel` saved with `save_pretrained`; their mixing with host rewards; their folders checked before anything
compiles, and the presets' fallback to the model-free demo."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from flowrl_jax import rewards  # noqa: E402
from flowrl_jax.jobs import train  # noqa: E402
from flowrl_jax.rl import plan as plan_lib  # noqa: E402
from flowrl_jax.config_lib import ConfigError  # noqa: E402
from flowrl_jax.models import clip  # noqa: E402
from flowrl_jax.rewards import device  # noqa: E402
from tests.conftest import load_config  # noqa: E402
from tests.test_clip import PARITY, PROJ, _processor, _reference, _structured_images, _tokenizer  # noqa: E402

PROMPTS = [{"prompt": p} for p in ("a photo of a cat", "two red dogs", "a blue circle and a square", "a dog")]
MLP_WIDTHS = (PROJ, 32, 16, 8, 4, 1)  # the aesthetic MLP's chain on the tiny model's 24-wide embedding (768 -> ... -> 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.world.reward_models for a tiny CLIPModel folder (PickScore, CLIPScore and the aesthetic's CLIP at once),
    an aesthetic MLP file, and the torch references."""
    root = tmp_path_factory.mktemp("reward_models")
    tokenizer = _tokenizer()
    reference = _reference("quick_gelu", legacy_eos=False, vocab_size=len(tokenizer))
    reference.save_pretrained(root / "clip")
    _processor(tokenizer).save_pretrained(root / "clip")
    torch.manual_seed(1)
    w = MLP_WIDTHS  # the published module's layout: Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear
    mlp = torch.nn.Module()
    mlp.layers = torch.nn.Sequential(torch.nn.Linear(w[0], w[1]), torch.nn.Dropout(0.2), torch.nn.Linear(w[1], w[2]), torch.nn.Dropout(0.2),
                                     torch.nn.Linear(w[2], w[3]), torch.nn.Dropout(0.1), torch.nn.Linear(w[3], w[4]), torch.nn.Linear(w[4], w[5]))
    mlp.eval()
    safetensors_numpy.save_file({k: v.numpy() for k, v in mlp.state_dict().items()}, str(root / "mlp.safetensors"))
    folders = {**device.FOLDERS, "pickscore": str(root / "clip"), "clipscore": str(root / "clip"),
               "aesthetic_clip": str(root / "clip"), "aesthetic_mlp": str(root / "mlp.safetensors")}
    return folders, reference, mlp


def _images(n=4, size=48):
    return np.stack([_structured_images(size, size, seed=i)[0] for i in range(n)]).astype(np.float32)


def test_device_rewards_equal_flow_grpo_formulas_in_torch(models):
    folders, reference, mlp = models
    images = _images()
    built = {n: device.FACTORIES[n](folders) for n in ("pickscore", "clipscore", "aesthetic")}
    model = clip.load_clip(folders["pickscore"])[0]
    pixels = np.array(model.preprocess(images))  # the same pixels for both sides: the towers and formulas are compared
    ids = built["pickscore"].tokenize(PROMPTS)
    with torch.no_grad():
        image = reference.get_image_features(pixel_values=torch.from_numpy(pixels.transpose(0, 3, 1, 2)).float()).pooler_output
        text = reference.get_text_features(input_ids=torch.from_numpy(ids).long()).pooler_output  # transformers 5: the projected embeds
        image, text = image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)
        cos = (image * text).sum(-1).numpy()
        scale = float(reference.logit_scale.exp())
        expected = {"pickscore": scale * cos / 26, "clipscore": scale * cos / 30, "aesthetic": mlp.layers(image).squeeze(1).numpy()}
    # The towers agree to PARITY per entry (tests/test_clip.py), so a unit embedding moves by <= sqrt(P) PARITY and the
    # cosine by <= 2 sqrt(P) PARITY = 2e-4: times exp(s) = 100 over 26 or 30 it is <= 7.5e-4; the aesthetic MLP is linear,
    # so its output moves by <= |W5 W4 W3 W2 W1|_2 sqrt(P) PARITY (the product's spectral norm, computed below).
    cos_bound = 2 * np.sqrt(PROJ) * PARITY
    chain = np.linalg.multi_dot([m.weight.detach().numpy().astype(np.float64) for m in mlp.layers if isinstance(m, torch.nn.Linear)][::-1])
    bounds = {"pickscore": scale * cos_bound / 26, "clipscore": scale * cos_bound / 30,
              "aesthetic": np.linalg.norm(chain, 2) * np.sqrt(PROJ) * PARITY}
    for name, reward in built.items():
        ours = np.asarray(reward.apply(reward.params, images, reward.tokenize(PROMPTS)))
        assert ours.shape == (4,) and np.ptp(expected[name]) > 10 * bounds[name], name  # the rows differ: a real signal
        np.testing.assert_allclose(ours, expected[name], rtol=0, atol=bounds[name], err_msg=name)  # bounds derived above


def test_host_and_device_rewards_mix_and_each_part_is_reported(models):
    folders, _, _ = models
    images = _images()
    fn = rewards.build((("pickscore", 2.0), ("jpeg_compressibility", 0.5)), folders)
    total, parts = fn(images, PROMPTS)
    assert set(parts) == {"pickscore", "jpeg_compressibility"}
    alone = rewards.build((("pickscore", 1.0),), folders)(images, PROMPTS)[0]
    # Exact: the same compiled function (one loaded reward per process) on the same images and ids, and the sum is the
    # same float32 numpy operations in the same order (0 + 2 p, then + 0.5 j): no reordering, so no rounding difference.
    np.testing.assert_array_equal(parts["pickscore"], alone)
    np.testing.assert_array_equal(total, 2.0 * parts["pickscore"] + 0.5 * parts["jpeg_compressibility"])


def test_device_reward_folders_are_checked_before_compiling(models, tmp_path):
    folders, _, _ = models
    fields = {"train.rewards": (("pickscore", 1.0),)}
    with pytest.raises(ConfigError, match=r"--config.world.reward_models.pickscore="):
        train.validate(load_config("configs/flow_grpo.py", **fields))  # no folder given
    with pytest.raises(ConfigError, match=r"world.reward_models.pickscore"):
        train.validate(load_config("configs/flow_grpo.py", **fields, **{"world.reward_models.pickscore": str(tmp_path / "nope")}))
    (tmp_path / "bad.npz").write_bytes(b"")
    np.savez(tmp_path / "bad.npz", **{"layers.0.weight": np.zeros((3, 3))})
    with pytest.raises(ValueError, match=r"layers.0.weight \[out, 24\]"):
        device.read_aesthetic_mlp(str(tmp_path / "bad.npz"), PROJ)
    with pytest.raises(ConfigError, match=r"reward_models\.pickscore.*allow_rewards_without_models=True"):  # no PickScore
        plan_lib.train_rewards(load_config("configs/sd35m_pickscore.py"))  # folder: the pod preset refuses, naming both flags
    config = load_config("configs/sd35m_pickscore.py", **{"train.allow_rewards_without_models": True})  # the demo, asked for
    used, warning = plan_lib.train_rewards(config)
    assert used == (("jpeg_compressibility", 1.0),) and "--config.world.reward_models.pickscore" in warning
    with pytest.raises(ConfigError, match=r"train\.rewards is empty"):  # GenEval's preset names no reward of its own
        plan_lib.train_rewards(load_config("configs/sd35m_geneval.py"))
    assert tuple(config.train.rewards) == (("pickscore", 1.0),)  # the config itself is left as it is
    config = load_config("configs/sd35m_pickscore.py", **{"world.reward_models.pickscore": folders["pickscore"]})
    assert plan_lib.train_rewards(config) == ((("pickscore", 1.0),), None)
