"""The shapes world: grammar round trip, prompt files and split, rendered scenes against their labels."""
import json

import numpy as np
import pytest

from flowrl_jax.data import shapes


@pytest.mark.parametrize("category", shapes.CATEGORIES)
def test_parse_round_trip(category):
    specs = shapes.all_specs(category)
    assert len({shapes.format_prompt(s) for s in specs}) == len(specs)
    for spec in specs:
        prompt = shapes.format_prompt(spec)
        assert shapes.parse_prompt(prompt) == spec
        assert json.loads(json.dumps(spec)) == spec


def test_examples_parse():
    assert shapes.parse_prompt("a circle left of a square") == {
        "category": "position", "relation": "left of",
        "objects": [{"shape": "circle", "color": None, "count": 1}, {"shape": "square", "color": None, "count": 1}]}
    assert shapes.parse_prompt("three triangles")["objects"] == [{"shape": "triangle", "color": None, "count": 3}]
    assert shapes.parse_prompt("one triangle")["category"] == "counting"
    assert shapes.parse_prompt("a red circle and a blue square")["objects"][1] == {"shape": "square", "color": "blue", "count": 1}


@pytest.mark.parametrize("prompt", ["a hexagon", "two triangle", "one triangles", "a circle and a circle",
                                    "a circle left of a circle", "a red circle and a red square", "a purple square", ""])
def test_parse_rejects(prompt):
    with pytest.raises(ValueError, match=repr(prompt).replace("[", r"\[")):
        shapes.parse_prompt(prompt)


def test_prompt_files_match_generator_and_split():
    train, test = shapes.make_prompt_sets()
    assert shapes.load_prompts("train") == train
    assert shapes.load_prompts("test") == test
    assert len(test) >= 400
    for split in (train, test):
        for row in split:
            assert shapes.parse_prompt(row["prompt"]) == row["spec"] and row["category"] == row["spec"]["category"]
    train_keys = {shapes.composition_key(r["spec"]) for r in train}
    for cat in shapes.CATEGORIES:
        rows = [r for r in test if r["category"] == cat]
        assert len(rows) == shapes.TEST_PER_CATEGORY
        held = {shapes.composition_key(r["spec"]) for r in rows}
        all_keys = {shapes.composition_key(s) for s in shapes.all_specs(cat)}
        if cat == "single_object":  # only 3 compositions: nothing held out
            assert held <= train_keys
        else:
            assert held and not held & train_keys
        assert all_keys - held <= train_keys  # train has every composition not held out
    assert {r["prompt"] for r in train} == {shapes.format_prompt(s) for c in shapes.CATEGORIES for s in shapes.all_specs(c)
                                            if shapes.composition_key(s) in train_keys}


def test_load_prompts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        shapes.load_prompts("train", str(tmp_path))
    (tmp_path / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="test.jsonl"):
        shapes.load_prompts("test", str(tmp_path))


def test_composition_key_ignores_phrasing():
    key = shapes.composition_key
    assert key(shapes.parse_prompt("a circle left of a square")) == key(shapes.parse_prompt("a square right of a circle"))
    assert key(shapes.parse_prompt("a circle above a square")) == key(shapes.parse_prompt("a square below a circle"))
    assert key(shapes.parse_prompt("a circle left of a square")) != key(shapes.parse_prompt("a square left of a circle"))
    assert key(shapes.parse_prompt("a red circle and a blue square")) == key(shapes.parse_prompt("a blue square and a red circle"))


@pytest.mark.parametrize("size", [32, 64])
def test_scenes_satisfy_labels(size):
    rng = np.random.default_rng(0)
    scale = size / 32
    for cat in shapes.CATEGORIES:
        for spec in shapes.all_specs(cat)[:: 1 if size == 32 else 3]:
            image, labels = shapes.sample_scene(spec, rng, size)
            assert image.shape == (size, size, 3) and image.dtype == np.float32
            assert image.min() >= -1 and image.max() <= 1
            want = [(o["shape"], o["color"]) for o in spec["objects"] for _ in range(o["count"])]
            assert [o["shape"] for o in labels] == [s for s, _ in want]
            assert all(c is None or o["color"] == c for o, (_, c) in zip(labels, want))
            boxes = [o["bbox"] for o in labels]
            for i, (x0, y0, x1, y1) in enumerate(boxes):
                assert 0 <= x0 < x1 <= size and 0 <= y0 < y1 <= size
                assert 7 * scale <= max(x1 - x0, y1 - y0) <= 12 * scale + 1
                for q in boxes[i + 1:]:  # at least one background pixel between bounding boxes
                    assert x0 > q[2] or q[0] > x1 or y0 > q[3] or q[1] > y1
            if spec["relation"]:
                a, b = labels[0]["center"], labels[1]["center"]
                assert shapes.relation_holds(spec["relation"], a, b, margin=shapes.REL_MARGIN * scale)
            outside = np.ones((size, size), bool)
            for x0, y0, x1, y1 in boxes:
                outside[y0:y1, x0:x1] = False
            # background pixels are written as the float32 background value itself (measured difference 0); allclose's
            # default rtol 1e-5 (84 eps) only matters if that ever went through float32 arithmetic (<= a few eps)
            assert np.allclose(image[outside], shapes.to_unit(shapes.BACKGROUND))


def test_unfixed_colors_vary():
    rng = np.random.default_rng(0)
    colors = {o["color"] for _ in range(20) for o in shapes.sample_scene("four circles", rng)[1]}
    assert colors == set(shapes.COLORS)


def test_deterministic_and_batch():
    specs = ["a circle", "three squares", "a red circle and a blue square", "a triangle below a square"]
    a = shapes.render_batch(specs, np.random.default_rng(7))
    b = shapes.render_batch(specs, np.random.default_rng(7))
    c = shapes.render_batch(specs, np.random.default_rng(8))
    assert a.shape == (4, 32, 32, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    rng = np.random.default_rng(7)
    np.testing.assert_array_equal(a, np.stack([shapes.sample_scene(s, rng)[0] for s in specs]))
