"""The learned reward's training data: labels computed on the fly (mirrors, swapped prompts) must be the
exact evaluator's labels of the images and prompts actually shown."""
import numpy as np

from flowrl_jax.data import shapes
from flowrl_jax.models import text
from flowrl_jax.pretrain import world_vocabulary
from flowrl_jax.rewards import learned, shapes_eval
from flowrl_jax.train_reward import Augmenter


def _data():
    rng = np.random.default_rng(0)
    prompts = shapes.load_prompts("train")
    return learned.make_reward_data(prompts, 96, rng)  # own/other-prompt scenes and corrupted ones (noise: clutter)


def test_mirrored_detections_equal_detecting_the_mirrored_images():
    data = _data()
    idx = np.arange(0, 96, 3)
    flip = np.arange(len(idx)) % 2 == 0
    got = learned.Detections(data["images"]).batch(idx, flip)
    images = data["images"][idx]
    images[flip] = images[flip, :, ::-1]
    want = shapes_eval.detect(images)
    order_got, order_want = np.lexsort((got["cy"], got["image"])), np.lexsort((want["cy"], want["image"]))
    for key in ("image", "shape", "color"):
        np.testing.assert_array_equal(got[key][order_got], want[key][order_want])
    for key in ("cx", "cy", "area"):
        np.testing.assert_allclose(got[key][order_got], want[key][order_want], atol=1e-6)


def test_augmented_batches_carry_the_evaluator_s_labels_of_what_they_show():
    data = _data()
    tokenizer = text.build_tokenizer(world_vocabulary())
    augment = Augmenter(data, lambda prompts: text.tokenize(tokenizer, prompts, 10), relabel=0.5, flip=0.5)
    idx = np.random.default_rng(1).choice(len(data["score"]), 64)
    batch, specs = augment.batch(idx, np.random.default_rng(2))
    swapped = [a is not b for a, b in zip(specs, [data["specs"][i] for i in idx])]
    assert 16 < sum(swapped) < 48 and all(q["category"] == data["specs"][i]["category"] for q, i in zip(specs, idx))
    want = shapes_eval.evaluate(batch["images"], specs)
    np.testing.assert_array_equal(batch["score"], want["score"])
    expected_ids, _ = text.tokenize(tokenizer, [shapes.format_prompt(q) for q in specs], 10)
    np.testing.assert_array_equal(batch["ids"], expected_ids)
    counts = np.zeros_like(batch["counts"])
    for b, found in enumerate(want["detections"]):
        for o in found:
            s = shapes.SHAPES.index(o["shape"]) if o["shape"] else len(shapes.SHAPES)
            counts[b, s, shapes.COLORS.index(o["color"])] += 1
    np.testing.assert_array_equal(batch["counts"], np.minimum(counts, 4))
    assert batch["counts"][:, -1].sum() > 0  # some clutter among the corrupted scenes
    np.testing.assert_array_equal(data["score"], shapes_eval.evaluate(data["images"], data["specs"])["score"])
    plain = Augmenter(data, lambda prompts: text.tokenize(tokenizer, prompts, 10), relabel=0.0, flip=0.0)
    np.testing.assert_array_equal(plain.batch(idx, np.random.default_rng(3))[0]["score"], data["score"][idx])


def test_palette_channels_are_the_evaluator_s_color_step():
    """Where `shapes_eval.segment` assigns a pixel to color k with coverage a, channel 3 + k holds a and the
    off-hue residual of k is within the evaluator's hue cut; unassigned colored pixels fail the cut."""
    images = _data()["images"][:32]
    feats = np.asarray(learned.palette_channels(images))
    code, alpha = shapes_eval.segment(images)
    k_count = len(shapes.COLORS)
    np.testing.assert_array_equal(feats[..., :3], images)
    coverage, residual = feats[..., 3 : 3 + k_count], feats[..., 3 + k_count :]
    b, y, x = np.nonzero(code >= 0)
    k = code[b, y, x]
    np.testing.assert_allclose(coverage[b, y, x, k], alpha[b, y, x], atol=1e-5)
    d2 = ((np.clip(images, -1, 1) - shapes.to_unit(shapes.BACKGROUND)) ** 2).sum(-1)
    bright = d2[b, y, x] > 0.05  # the residual is normalized by |d|^2 (+1e-3): compare where that is exact enough
    assert (residual[b, y, x, k][bright] <= shapes_eval.MAX_HUE_SIN ** 2 + 1e-3).all()
    assert len(k) > 1000 and bright.mean() > 0.9


def test_mirror_average_is_the_mean_of_the_two_views_and_is_mirror_invariant():
    """With `mirror_ids`, the reward is the mean of its single-view outputs on (image, prompt) and (mirrored
    image, the prompt re-phrased with left <-> right), so it is exactly invariant under that pair of mirrors,
    as the exact score is."""
    import jax

    tokenizer = text.build_tokenizer(world_vocabulary())
    specs = [p["spec"] for p in shapes.load_prompts("test") if p["category"] == "position"][:6]
    mirrored_specs = [dict(q, relation={"left of": "right of", "right of": "left of"}.get(q["relation"], q["relation"])) for q in specs]
    assert sum(q != m for q, m in zip(specs, mirrored_specs)) >= 2  # some prompts do change under the mirror
    images = shapes.render_batch(specs, np.random.default_rng(0))
    ids, mask = text.tokenize(tokenizer, [shapes.format_prompt(q) for q in specs], 10)
    ids_m, mask_m = text.tokenize(tokenizer, [shapes.format_prompt(q) for q in mirrored_specs], 10)
    model = learned.LearnedReward(len(tokenizer), width=16, heads=2, mirror_ids=tuple(tokenizer.convert_tokens_to_ids(["left", "right"])))
    params = model.init(jax.random.PRNGKey(0), images[:1], ids[:1], mask[:1], True)["params"]
    apply = lambda x, i, m, **kw: np.asarray(model.apply({"params": params}, x, i, m, True, **kw)[0])  # noqa: E731
    one, other = apply(images, ids, mask, mirror=False), apply(images[:, :, ::-1], ids_m, mask_m, mirror=False)
    assert np.abs(one - other).max() > 1e-4  # an untrained net is not symmetric by itself
    np.testing.assert_allclose(apply(images, ids, mask), (one + other) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(apply(images[:, :, ::-1], ids_m, mask_m), apply(images, ids, mask), rtol=1e-5, atol=1e-6)
    exact = shapes_eval.evaluate(images, specs)["score"]
    np.testing.assert_array_equal(shapes_eval.evaluate(images[:, :, ::-1].copy(), mirrored_specs)["score"], exact)
