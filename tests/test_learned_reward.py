"""The learned reward's training data: labels computed on the fly (mirrors, swapped prompts) must be the
exact evaluator's labels of the images and prompts actually shown."""
import numpy as np

from flowrl_jax.data import shapes
from flowrl_jax.models import text
from flowrl_jax.worlds.shapes.pipeline import world_vocabulary
from flowrl_jax.worlds.shapes import learned, evaluator
from flowrl_jax.jobs.train_reward import Augmenter

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


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
    want = evaluator.detect(images)
    order_got, order_want = np.lexsort((got["cy"], got["image"])), np.lexsort((want["cy"], want["image"]))
    for key in ("image", "shape", "color"):
        np.testing.assert_array_equal(got[key][order_got], want[key][order_want])
    for key in ("cx", "cy", "area"):
        # float64 sums over an object's <= 150 pixels, mirrored into another order: <= 150 x 2.2e-16 of sum|terms|
        # (<= 150 coverage x 32 px), i.e. <= 1e-12 for cx, cy and 5e-12 for the area (measured 3.6e-15)
        np.testing.assert_allclose(got[key][order_got], want[key][order_want], rtol=0, atol=1e-9)


def test_augmented_batches_carry_the_evaluator_s_labels_of_what_they_show():
    data = _data()
    tokenizer = text.build_tokenizer(world_vocabulary())
    augment = Augmenter(data, lambda prompts: text.tokenize(tokenizer, prompts, 10), relabel=0.5, flip=0.5)
    idx = np.random.default_rng(1).choice(len(data["score"]), 64)
    batch, specs = augment.batch(idx, np.random.default_rng(2))
    swapped = [a is not b for a, b in zip(specs, [data["specs"][i] for i in idx])]
    assert 16 < sum(swapped) < 48 and all(q["category"] == data["specs"][i]["category"] for q, i in zip(specs, idx))
    want = evaluator.evaluate(batch["images"], specs)
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
    np.testing.assert_array_equal(data["score"], evaluator.evaluate(data["images"], data["specs"])["score"])
    plain = Augmenter(data, lambda prompts: text.tokenize(tokenizer, prompts, 10), relabel=0.0, flip=0.0)
    np.testing.assert_array_equal(plain.batch(idx, np.random.default_rng(3))[0]["score"], data["score"][idx])


def test_palette_channels_are_the_evaluator_s_color_step():
    """Where `evaluator.segment` assigns a pixel to color k with coverage a, channel 3 + k holds a and the
    off-hue residual of k is within the evaluator's hue cut; unassigned colored pixels fail the cut."""
    images = _data()["images"][:32]
    feats = np.asarray(learned.palette_channels(images))
    code, alpha = evaluator.segment(images)
    k_count = len(shapes.COLORS)
    np.testing.assert_array_equal(feats[..., :3], images)
    coverage, residual = feats[..., 3 : 3 + k_count], feats[..., 3 + k_count :]
    b, y, x = np.nonzero(code >= 0)
    k = code[b, y, x]
    # float32 against float64 of a = d . v / |v|^2 (3-term dots, a division; the float32 background and palette shift d and
    # v by <= eps): <= ~10 eps/2 |d| / |v| <= 1e-6 (|d| <= 2.5, |v| >= 1.44); atol 1e-5 = 84 eps (measured 1.2e-7)
    np.testing.assert_allclose(coverage[b, y, x, k], alpha[b, y, x], atol=1e-5)
    d2 = ((np.clip(images, -1, 1) - shapes.to_unit(shapes.BACKGROUND)) ** 2).sum(-1)
    bright = d2[b, y, x] > 0.05  # the residual is normalized by |d|^2 (+1e-3): compare where that is exact enough
    # r / (|d|^2 + 1e-3) <= r / |d|^2 <= MAX^2 wherever the evaluator assigns k, up to float32 rounding: r cancels 3 terms
    # <= |d|^2 (<= 12 eps/2 of |d|^2), and the float32 background and palette (each off by <= 3.5 eps/2) move r by
    # <= 2 sqrt(r) 7 eps/2 <= 3.5 eps/2 |d| (sqrt(r) <= MAX |d|), <= 16 eps/2 of |d|^2 >= 0.05: 14 eps in all (the 1e-3
    # slack used before was 8,400 eps; measured max residual - MAX^2 = -1.6e-3)
    assert (residual[b, y, x, k][bright] <= evaluator.MAX_HUE_SIN ** 2 + 16 * EPS).all()
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
    params = jax.jit(model.init, static_argnums=4)(jax.random.PRNGKey(0), images[:1], ids[:1], mask[:1], True)["params"]
    jitted = jax.jit(model.apply, static_argnums=4, static_argnames="mirror")  # eager dispatch op by op took ~60 s

    def apply(x, i, m, **kw):
        return np.asarray(jitted({"params": params}, x, i, m, True, **kw)[0])
    one, other = apply(images, ids, mask, mirror=False), apply(images[:, :, ::-1], ids_m, mask_m, mirror=False)
    # The one- and two-view programs run batches of 6 and 12, so float32 sums may be ordered differently: the net has
    # ~3,000 reduced terms and elementwise ops (convs and matmuls sum K = 2,429, sums 352, 186 elementwise; jaxpr), so the
    # logit (|logit| < 1 here) moves by <= 3,000 eps and the score, through sigmoid' <= 1/4, by <= 750 eps = 8.9e-5.
    tol = 750 * EPS
    assert np.abs(one - other).max() > 10 * tol  # an untrained net is not symmetric by itself (measured 0.057)
    np.testing.assert_allclose(apply(images, ids, mask), (one + other) / 2, rtol=0, atol=tol)  # measured 3e-8
    np.testing.assert_allclose(apply(images[:, :, ::-1], ids_m, mask_m), apply(images, ids, mask), rtol=0, atol=tol)
    exact = evaluator.evaluate(images, specs)["score"]
    np.testing.assert_array_equal(evaluator.evaluate(images[:, :, ::-1].copy(), mirrored_specs)["score"], exact)
