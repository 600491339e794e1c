"""The embedded shapes world: a GenEval-style text-to-image world of colored shapes on a dark background.

Images are float32 `[H, W, 3]` in [-1, 1] (default 32x32; any size, object sizes scale with it). Objects are
SHAPES (circle, square, upright isosceles triangle with height = base) in COLORS (a fixed saturated palette)
on `BACKGROUND`, anti-aliased by 4x4 supersampling, extent 7-12 px at 32x32 (scaled with the size), fully
inside the image, and with at least one background pixel between any two objects' pixel bounding boxes.
Coordinates are pixels, x to the right and y downwards, pixel (row i, column j) covering [j, j+1) x [i, i+1).

Prompts follow GenEval's six categories (exact phrasing):
    single_object  "a triangle"                     colors      "a blue square"
    two_object     "a circle and a square"          counting    "three triangles" (one .. four)
    position       "a circle left of a square"      color_attr  "a red circle and a blue square"
(relations: left of, right of, above, below). A spec is the JSON-serializable dict
`{"category", "objects": [{"shape", "color" (None = any), "count"}], "relation" (None unless position)}`.
"A left of B" means centroid_x(A) < centroid_x(B) with |dx| > |dy| ("above": y(A) < y(B), |dy| > |dx|);
the renderer keeps a margin of 2 px (at 32x32) on |dx| - |dy| so the relation holds clearly.

Prompt sets (`make_prompt_sets`): a composition is a prompt's meaning (`composition_key`: object order in
two_object/color_attr and the phrasing "B right of A" vs "A left of B" do not matter). The test set holds 70
lines per category, cycling over compositions absent from train: (color, shape) pairs for colors, (shape,
count) pairs for counting, shape pairs for two_object, (pair, relation) for position, (colored pair) for
color_attr. single_object has only 3 compositions, so nothing is held out there and its test prompts are
train prompts. Train holds one line per prompt of every composition not held out (every phrasing).
"""
from __future__ import annotations

import itertools
import json
import os
import re

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "yellow")
PALETTE = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40)}
BACKGROUND = (20, 20, 28)
CATEGORIES = ("single_object", "colors", "two_object", "counting", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS = ("one", "two", "three", "four")

SUPERSAMPLE = 4
EXTENT = (7.0, 12.0)  # object extent range in px at 32x32
REL_MARGIN = 2.0  # |dx| - |dy| margin in px at 32x32 for rendered position prompts
TEST_PER_CATEGORY = 70
PROMPT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts")

_SHAPE = "(circle|square|triangle)"
_COLOR = "(red|green|blue|yellow)"
_GRAMMAR = (
    ("single_object", re.compile(rf"a {_SHAPE}")),
    ("colors", re.compile(rf"a {_COLOR} {_SHAPE}")),
    ("two_object", re.compile(rf"a {_SHAPE} and a {_SHAPE}")),
    ("counting", re.compile(rf"(one|two|three|four) {_SHAPE}(s?)")),
    ("position", re.compile(rf"a {_SHAPE} (left of|right of|above|below) a {_SHAPE}")),
    ("color_attr", re.compile(rf"a {_COLOR} {_SHAPE} and a {_COLOR} {_SHAPE}")),
)


def to_unit(rgb) -> np.ndarray:
    """RGB in [0, 255] -> float32 in [-1, 1]."""
    return np.asarray(rgb, np.float32) / 127.5 - 1.0


def _obj(shape, color=None, count=1) -> dict:
    return {"shape": shape, "color": color, "count": count}


def _spec(category, objects, relation=None) -> dict:
    return {"category": category, "objects": objects, "relation": relation}


def parse_prompt(prompt: str) -> dict:
    """Prompt string (case and extra spaces ignored) -> spec dict. Raises ValueError naming the prompt if
    it is not in the grammar (including two equal shapes, or two equal colors in color_attr)."""
    text = " ".join(prompt.strip().lower().split())
    for category, pattern in _GRAMMAR:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        g = m.groups()
        if category == "single_object":
            return _spec(category, [_obj(g[0])])
        if category == "colors":
            return _spec(category, [_obj(g[1], g[0])])
        if category == "counting" and (g[2] == "s") == (g[0] != "one"):
            return _spec(category, [_obj(g[1], None, NUMBERS.index(g[0]) + 1)])
        if category == "two_object" and g[0] != g[1]:
            return _spec(category, [_obj(g[0]), _obj(g[1])])
        if category == "position" and g[0] != g[2]:
            return _spec(category, [_obj(g[0]), _obj(g[2])], g[1])
        if category == "color_attr" and g[1] != g[3] and g[0] != g[2]:
            return _spec(category, [_obj(g[1], g[0]), _obj(g[3], g[2])])
        break
    raise ValueError(f"prompt {prompt!r} is not in the shapes-world grammar (see flowrl_jax/data/shapes.py)")


def format_prompt(spec: dict) -> str:
    """Spec dict -> its prompt string (the inverse of `parse_prompt`)."""
    cat, objs = spec["category"], spec["objects"]
    noun = [(f"a {o['color']} {o['shape']}" if o["color"] else f"a {o['shape']}") for o in objs]
    if cat in ("single_object", "colors"):
        return noun[0]
    if cat == "counting":
        n = objs[0]["count"]
        return f"{NUMBERS[n - 1]} {objs[0]['shape']}" + ("s" if n > 1 else "")
    if cat == "position":
        return f"{noun[0]} {spec['relation']} {noun[1]}"
    return f"{noun[0]} and {noun[1]}"


def as_spec(prompt_or_spec) -> dict:
    """A prompt string or a spec dict -> the spec dict."""
    return parse_prompt(prompt_or_spec) if isinstance(prompt_or_spec, str) else prompt_or_spec


def relation_holds(relation: str, a_xy, b_xy, margin: float = 0.0):
    """Whether `A relation B` holds between centroids a = (x, y), b = (x, y) (scalars or arrays): the
    difference b - a has the relation's sign on the relation's axis, which dominates the other by > margin."""
    dx, dy = np.subtract(b_xy[0], a_xy[0]), np.subtract(b_xy[1], a_xy[1])
    sign = 1.0 if relation in ("left of", "above") else -1.0
    along, across = (dx, dy) if relation in ("left of", "right of") else (dy, dx)
    return (sign * along > 0) & (np.abs(along) - np.abs(across) > margin)


def _coverage(shape: str, x0: float, y0: float, e: float, bbox) -> np.ndarray:
    """Fractional coverage [h, w] of one object on the pixels of its bbox, by SUPERSAMPLE^2 point samples."""
    bx0, by0, bx1, by1 = bbox
    offs = (np.arange(SUPERSAMPLE, dtype=np.float64) + 0.5) / SUPERSAMPLE
    xs = (np.arange(bx0, bx1)[:, None] + offs[None, :]).reshape(-1)
    ys = (np.arange(by0, by1)[:, None] + offs[None, :]).reshape(-1)
    u, v = xs[None, :] - x0, ys[:, None] - y0  # position inside the object's [0, e]^2 box
    if shape == "square":
        inside = (u >= 0) & (u < e) & (v >= 0) & (v < e)
    elif shape == "circle":
        inside = (u - e / 2) ** 2 + (v - e / 2) ** 2 < (e / 2) ** 2
    else:  # upright triangle: apex (e/2, 0), base from (0, e) to (e, e)
        inside = (v >= 0) & (v < e) & (np.abs(u - e / 2) < v / 2)
    h, w = by1 - by0, bx1 - bx0
    return inside.reshape(h, SUPERSAMPLE, w, SUPERSAMPLE).mean(axis=(1, 3))


def _centroid(shape: str, x0: float, y0: float, e: float):
    return (x0 + e / 2, y0 + (2 * e / 3 if shape == "triangle" else e / 2))


def _instances(spec: dict, rng: np.random.Generator):
    """(shape, color) per object to draw; colors the spec leaves open are drawn uniformly."""
    out = []
    for o in spec["objects"]:
        for _ in range(o["count"]):
            out.append((o["shape"], o["color"] or COLORS[rng.integers(len(COLORS))]))
    return out


def _layout(n: int, size: int, rng: np.random.Generator):
    """n non-overlapping (x0, y0, extent, pixel bbox) placements, or None when random placement failed."""
    scale = size / 32.0
    placed = []
    for e in rng.uniform(EXTENT[0] * scale, EXTENT[1] * scale, n):
        for _ in range(30):
            x0, y0 = rng.uniform(0, size - e, 2)
            bbox = (int(np.floor(x0)), int(np.floor(y0)), int(np.ceil(x0 + e)), int(np.ceil(y0 + e)))
            if all(bbox[0] > q[2] or q[0] > bbox[2] or bbox[1] > q[3] or q[1] > bbox[3] for *_, q in placed):
                placed.append((x0, y0, e, bbox))
                break
        else:
            return None
    return placed


def sample_scene(prompt_or_spec, rng: np.random.Generator, size: int = 32):
    """Render a random scene satisfying the prompt. Returns (image float32 [size, size, 3] in [-1, 1],
    labels: one dict per object {shape, color, center (x, y) area centroid, bbox (x0, y0, x1, y1) pixel
    bounds, end exclusive}), objects in spec order."""
    spec = as_spec(prompt_or_spec)
    inst = _instances(spec, rng)
    for _ in range(1000):
        placed = _layout(len(inst), size, rng)
        if placed is None:
            continue
        centers = [_centroid(s, x0, y0, e) for (s, _), (x0, y0, e, _) in zip(inst, placed)]
        if spec["relation"] is None or relation_holds(spec["relation"], centers[0], centers[1], REL_MARGIN * size / 32):
            break
    else:
        raise RuntimeError(f"could not lay out {format_prompt(spec)!r} at size {size}")
    bg = to_unit(BACKGROUND)
    image = np.broadcast_to(bg, (size, size, 3)).copy()
    labels = []
    for (shape, color), (x0, y0, e, bbox), center in zip(inst, placed, centers):
        cov = _coverage(shape, x0, y0, e, bbox)
        image[bbox[1]:bbox[3], bbox[0]:bbox[2]] += cov[..., None] * (to_unit(PALETTE[color]) - bg)
        labels.append({"shape": shape, "color": color, "center": (float(center[0]), float(center[1])),
                       "bbox": tuple(bbox)})
    return image.astype(np.float32), labels


def render_batch(specs, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """Prompts or specs (length B) -> images float32 [B, size, size, 3], one random scene each."""
    return np.stack([sample_scene(s, rng, size)[0] for s in specs])


def composition_key(spec: dict) -> tuple:
    """A prompt's meaning, independent of object order and of the relation's phrasing."""
    objs = [(o["shape"], o["color"] or "", o["count"]) for o in spec["objects"]]
    rel = spec["relation"]
    if rel in ("right of", "below"):
        objs, rel = objs[::-1], {"right of": "left of", "below": "above"}[rel]
    elif rel is None:
        objs = sorted(objs)
    return (spec["category"], tuple(objs), rel)


def all_specs(category: str) -> list[dict]:
    """Every spec of a category (every phrasing), in a fixed order."""
    pairs = list(itertools.permutations(SHAPES, 2))
    if category == "single_object":
        return [_spec(category, [_obj(s)]) for s in SHAPES]
    if category == "colors":
        return [_spec(category, [_obj(s, c)]) for c in COLORS for s in SHAPES]
    if category == "two_object":
        return [_spec(category, [_obj(a), _obj(b)]) for a, b in pairs]
    if category == "counting":
        return [_spec(category, [_obj(s, None, n)]) for s in SHAPES for n in range(1, 5)]
    if category == "position":
        return [_spec(category, [_obj(a), _obj(b)], r) for a, b in pairs for r in RELATIONS]
    if category == "color_attr":
        return [_spec(category, [_obj(a, ca), _obj(b, cb)]) for a, b in pairs
                for ca, cb in itertools.permutations(COLORS, 2)]
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


# compositions held out of train per category (single_object: none, it has only 3)
HOLDOUT = {"single_object": 0, "colors": 3, "two_object": 1, "counting": 3, "position": 3, "color_attr": 9}


def _attributes(specs) -> set:
    return {(k, v) for s in specs for o in s["objects"] for k, v in o.items()} | {("rel", s["relation"]) for s in specs}


def make_prompt_sets(seed: int = 0):
    """(train, test) lists of {"prompt", "category", "spec"}; see the module docstring for the split."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cat in CATEGORIES:
        specs = all_specs(cat)
        keys = sorted({composition_key(s) for s in specs})
        while True:  # held-out keys drawn so that train still shows every shape, color, count and relation
            held = {keys[i] for i in rng.choice(len(keys), HOLDOUT[cat], replace=False)}
            kept = [s for s in specs if composition_key(s) not in held]
            if _attributes(kept) == _attributes(specs):
                break
        held_specs = [s for s in specs if composition_key(s) in held] or specs
        order = rng.permutation(len(held_specs))
        train += [_entry(s) for s in kept]
        test += [_entry(held_specs[order[i % len(order)]]) for i in range(TEST_PER_CATEGORY)]
    return train, test


def _entry(spec: dict) -> dict:
    return {"prompt": format_prompt(spec), "category": spec["category"], "spec": spec}


def write_prompt_files(seed: int = 0, directory: str = PROMPT_DIR) -> None:
    """Write `make_prompt_sets(seed)` to `directory/{train,test}.jsonl`, one JSON object per line."""
    os.makedirs(directory, exist_ok=True)
    for split, rows in zip(("train", "test"), make_prompt_sets(seed)):
        with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def load_prompts(split: str, directory: str = PROMPT_DIR) -> list[dict]:
    """Read `directory/{split}.jsonl` -> list of {"prompt", "category", "spec"}."""
    return load_prompt_file(os.path.join(directory, f"{split}.jsonl"))


def load_prompt_file(path: str) -> list[dict]:
    """Read and check a prompt file: JSONL, one {"prompt", "category", "spec"} object per line.
    A missing file raises FileNotFoundError; an empty or malformed one ValueError naming the line and the fix."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} not found (the shipped sets are train/test in {PROMPT_DIR})")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file {path} line {number} is not JSON ({e.msg}); each line must be "
                                 '{"prompt": ..., "category": ..., "spec": ...}') from None
            missing = [k for k in ("prompt", "category", "spec") if not isinstance(row, dict) or k not in row]
            if missing or row["category"] not in CATEGORIES:
                problem = f"lacks {missing}" if missing else f"has unknown category {row['category']!r} (known: {CATEGORIES})"
                raise ValueError(f"prompt file {path} line {number} {problem}; write prompt files with "
                                 "flowrl_jax.data.shapes.write_prompt_files()")
            rows.append(row)
    if not rows:
        raise ValueError(f"prompt file {path} is empty: it needs at least one JSONL prompt line")
    return rows
