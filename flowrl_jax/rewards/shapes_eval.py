"""Exact programmatic evaluator of the embedded shapes world: GenEval-style strict accuracy and Flow-GRPO
partial credit, computed from pixels alone.

`evaluate(images [B, H, W, 3] in [-1, 1], specs (B prompts or spec dicts))` ->
`{"strict": float [B] of 0/1, "score": float [B] in [0, 1], "detections": per image a list of
{shape, color, center (x, y), area}}`.

Detection (NumPy, vectorized over the batch; scipy is not needed):
1. Color: every pixel p is explained as a mix `bg + a (c - bg)` of the background and one palette color c
   (the color whose bg-c segment is nearest). It is an object pixel of c when it is closer to c than to
   the background (a > 1/2) and its distance to that segment is at most `MAX_HUE_SIN` |p - bg| (a hue
   within ~14 degrees of c's: white, gray or in-between hues such as orange belong to no color).
   Anti-aliased edge pixels (a <= 1/2) form no object.
2. Objects: 8-connected components of object pixels of one color (min-label propagation with pointer
   jumping); components under 3 px at 32x32 (scaled with the image area) are dropped. Each component
   also takes the adjacent edge pixels of its color; every pixel is weighted by its coverage a.
3. Shape, from the coverage-weighted central moments mu_pq (y downwards):
       skew    = mu03 / mu02^1.5                          upright triangle -0.57, circle and square 0
       corners = (mu40 + mu04 - 6 mu22) / (mu20 + mu02)^2  axis-aligned square -0.6, circle 0
       aspect  = sqrt(mu20 / mu02)                         circle and square 1, triangle 0.87
       compact = area / (12 sqrt(mu20 mu02))              square 1, circle 1.05, triangle 0.87
   triangle: skew <= -0.28 and aspect in [0.6, 1.25]; square / circle: |skew| < 0.28, aspect in
   [0.75, 1.33] and corners <= -0.3 / > -0.3; all need compact >= 0.7 (rings, L shapes, lines fail);
   anything else is no shape (shape None, ignored by the clauses). Center: the weighted centroid.
   On rendered scenes the features keep wide margins to these cuts up to pixel noise of std ~0.1.

Clauses per category (count clauses use the detected objects of the named shape, any color; n = count):
    single_object  count(A)                 colors      count(A), color(A)
    two_object     count(A), count(B)       counting    count_exact(A)
    position       count(A), count(B), relation(A, B)
    color_attr     count(A), count(B), color(A), color(B)
- count(X), at least n: strict iff found >= n; partial credit 1 - max(n - found, 0) / n.
- count_exact(X): strict iff found == n; partial credit max(1 - |n - found| / n, 0).
- color(X): strict iff at least one X is found and all found X's have the color; partial credit
  1 - (found - found_with_color) / found, 0 when none is found.
- relation(A, B): the largest detected A and the largest detected B satisfy `shapes.relation_holds`
  (centroid difference dominated by the relation's axis, with the right sign); 0/1, 0 if either is absent.
`score` is the mean of the prompt's clause credits and `strict` is 1 iff every clause holds.
Clutter: every detected component that is none of the three shapes (specks, smears, noise blobs) fails
`strict` and halves `score`, so noise or smeared samples collect no presence credit (as GenEval's
detector finds no objects in noise) and an RL policy cannot farm it. Hence strict == 1 iff score == 1.
"""
from __future__ import annotations

import numpy as np

from flowrl_jax.data import shapes

MAX_HUE_SIN = 0.25
MIN_COMPONENT_PX = 3.0  # at 32x32
_SHAPE_ID = {s: i for i, s in enumerate(shapes.SHAPES)}
_COLOR_ID = {c: i for i, c in enumerate(shapes.COLORS)}
_REL_ID = {r: i for i, r in enumerate(shapes.RELATIONS)}
_CAT_ID = {c: i for i, c in enumerate(shapes.CATEGORIES)}
_NEIGHBORS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


def segment(images: np.ndarray):
    """images [B, H, W, 3] in [-1, 1] (clipped to it) -> (color id int [B, H, W], -1 where no palette
    color explains the pixel; coverage a float32 [B, H, W] of that color). Step 1 of the module docstring."""
    bg = shapes.to_unit(shapes.BACKGROUND)
    v = np.stack([shapes.to_unit(shapes.PALETTE[c]) - bg for c in shapes.COLORS])  # [K, 3]
    vv = (v * v).sum(1)
    d = np.clip(np.asarray(images, np.float32), -1.0, 1.0) - bg
    a = np.clip((d @ v.T) / vv, 0.0, 1.0)  # [B, H, W, K]
    resid = (d * d).sum(-1, keepdims=True) - 2 * a * (d @ v.T) + a * a * vv
    k = resid.argmin(-1)
    alpha = np.take_along_axis(a, k[..., None], -1)[..., 0]
    ok = np.take_along_axis(resid, k[..., None], -1)[..., 0] <= (MAX_HUE_SIN ** 2) * (d * d).sum(-1)
    return np.where(ok & (alpha > 0), k, -1), alpha


def _components(code: np.ndarray) -> np.ndarray:
    """code int [B, H, W] (-1 = none) -> component id int [B, H, W] (-1 = none), ids 0..n-1 in raster
    order, 8-connectivity between pixels of equal code."""
    B, H, W = code.shape
    pad = np.full((B, H + 2, W + 2), -1, code.dtype)
    pad[:, 1:-1, 1:-1] = code
    flat = pad.reshape(-1)
    idx = np.flatnonzero(flat >= 0)
    n = idx.size
    out = np.full(flat.shape, -1, np.int64)
    if n == 0:
        return out.reshape(pad.shape)[:, 1:-1, 1:-1]
    pos = np.full(flat.shape, -1, np.int64)
    pos[idx] = np.arange(n)
    offsets = np.array([dy * (W + 2) + dx for dy, dx in _NEIGHBORS])
    nb = idx[:, None] + offsets
    self_ = np.arange(n)[:, None]
    nbc = np.concatenate([self_, np.where(flat[nb] == flat[idx][:, None], pos[nb], self_)], 1)
    lab = np.arange(n)
    while True:
        new = lab[nbc].min(1)
        while True:
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, lab):
            break
        lab = new
    roots = lab == np.arange(n)
    out[idx] = (np.cumsum(roots) - 1)[lab]
    return out.reshape(pad.shape)[:, 1:-1, 1:-1]


def detect(images: np.ndarray) -> dict:
    """images [B, H, W, 3] -> objects: dict of arrays [N] {image, shape (id into shapes.SHAPES, -1 = none
    of them), color (id into shapes.COLORS), cx, cy, area (coverage-weighted px), skew, corners, aspect,
    compact}. Steps 2-3 of the module docstring."""
    images = np.asarray(images, np.float32)
    B, H, W, _ = images.shape
    code, alpha = segment(images)
    comp = _components(np.where(alpha > 0.5, code, -1))
    keep = np.bincount(comp[comp >= 0], minlength=int(comp.max(initial=-1)) + 1) >= MIN_COMPONENT_PX * H * W / 1024
    comp = np.append(np.where(keep, np.cumsum(keep) - 1, -1), -1)[comp]  # drop small ones, -1 stays -1
    n = int(keep.sum())
    # edge pixels (a <= 1/2) join an adjacent component of their color
    pc = np.pad(comp, ((0, 0), (1, 1), (1, 1)), constant_values=-1)
    pk = np.pad(np.where(comp >= 0, code, -1), ((0, 0), (1, 1), (1, 1)), constant_values=-1)
    edge = (code >= 0) & (comp < 0)
    owner = np.full(comp.shape, -1, np.int64)
    for dy, dx in _NEIGHBORS:
        c_nb = pc[:, 1 + dy:1 + dy + H, 1 + dx:1 + dx + W]
        k_nb = pk[:, 1 + dy:1 + dy + H, 1 + dx:1 + dx + W]
        owner = np.where(edge & (k_nb == code), np.maximum(owner, c_nb), owner)
    owner = np.where(comp >= 0, comp, owner)
    b, y, x = np.nonzero(owner >= 0)
    o = owner[b, y, x]
    w = np.minimum(alpha[b, y, x], 1.0).astype(np.float64)
    area = np.bincount(o, w, n)
    cx = np.bincount(o, w * (x + 0.5), n) / area
    cy = np.bincount(o, w * (y + 0.5), n) / area
    u, v = x + 0.5 - cx[o], y + 0.5 - cy[o]
    mom = lambda p, q: np.bincount(o, w * u ** p * v ** q, n) / area
    m20, m02 = mom(2, 0), np.maximum(mom(0, 2), 1e-12)
    skew = mom(0, 3) / m02 ** 1.5
    corners = (mom(4, 0) + mom(0, 4) - 6 * mom(2, 2)) / (m20 + m02) ** 2
    aspect = np.sqrt(m20 / m02)
    compact = area / np.sqrt(np.maximum(m20 * m02, 1e-12)) / 12
    image, color = np.zeros(n, np.int64), np.zeros(n, np.int64)
    image[o], color[o] = b, code[b, y, x]  # constant within a component
    return dict(image=image, color=color, cx=cx, cy=cy, area=area, skew=skew, corners=corners, aspect=aspect,
                compact=compact, shape=classify(skew, corners, aspect, compact))


def classify(skew, corners, aspect, compact) -> np.ndarray:
    """Shape id per object (-1: none of the three) from its moment features (see `detect`)."""
    solid = compact >= 0.7
    level = (np.abs(skew) < 0.28) & (aspect >= 0.75) & (aspect <= 1 / 0.75) & solid
    triangle = (skew <= -0.28) & (aspect >= 0.6) & (aspect <= 1.25) & solid
    return np.select([triangle, level & (corners <= -0.3), level], [2, 1, 0], -1)


def _spec_arrays(specs):
    """Specs -> int arrays: category [B], shape/color/count [B, 2] (-1 / -1 / 0 where absent), relation [B]."""
    B = len(specs)
    cat, rel = np.zeros(B, np.int64), np.full(B, -1, np.int64)
    shape, color, count = np.full((B, 2), -1, np.int64), np.full((B, 2), -1, np.int64), np.zeros((B, 2), np.int64)
    for i, spec in enumerate(specs):
        cat[i] = _CAT_ID[spec["category"]]
        rel[i] = _REL_ID[spec["relation"]] if spec["relation"] else -1
        for j, o in enumerate(spec["objects"]):
            shape[i, j], count[i, j] = _SHAPE_ID[o["shape"]], o["count"]
            color[i, j] = _COLOR_ID[o["color"]] if o["color"] else -1
    return cat, shape, color, count, rel


# clauses used per category, columns [count(A), count(B), color(A), color(B), relation(A, B)]
_CLAUSES = np.array([{"single_object": [1, 0, 0, 0, 0], "colors": [1, 0, 1, 0, 0], "two_object": [1, 1, 0, 0, 0],
                      "counting": [1, 0, 0, 0, 0], "position": [1, 1, 0, 0, 1], "color_attr": [1, 1, 1, 1, 0]}[c]
                     for c in shapes.CATEGORIES], bool)


def score_objects(objects: dict, specs) -> tuple[np.ndarray, np.ndarray]:
    """Objects {image, shape, color, cx, cy, area} (arrays; shape -1 is ignored) and B specs ->
    (strict float32 [B] of 0/1, score float32 [B] in [0, 1]) by the clauses of the module docstring."""
    specs = [shapes.as_spec(s) for s in specs]
    cat, shape, color, count, rel = _spec_arrays(specs)
    B, S, K = len(specs), len(shapes.SHAPES), len(shapes.COLORS)
    valid = np.asarray(objects["shape"]) >= 0
    img, shp, col = (np.asarray(objects[k])[valid] for k in ("image", "shape", "color"))
    area, cx, cy = (np.asarray(objects[k], np.float64)[valid] for k in ("area", "cx", "cy"))
    hist = np.zeros((B, S, K), np.int64)
    np.add.at(hist, (img, shp, col), 1)
    rows = np.arange(B)[:, None]
    found = hist.sum(2)[rows, np.maximum(shape, 0)]  # [B, 2]
    with_color = hist[rows, np.maximum(shape, 0), np.maximum(color, 0)]
    req = np.maximum(count, 1)
    exact = (cat == _CAT_ID["counting"])[:, None]
    count_credit = np.where(exact, np.maximum(1 - np.abs(req - found) / req, 0), 1 - np.maximum(req - found, 0) / req)
    color_credit = np.where(found > 0, with_color / np.maximum(found, 1), 0.0)
    # the largest object of each (image, shape): last of its group after sorting by (image, shape, area)
    key = img * S + shp
    order = np.lexsort((area, key))
    last = order[np.r_[key[order][1:] != key[order][:-1], True]] if order.size else order
    largest = np.full(B * S, -1, np.int64)
    largest[key[last]] = last
    a, b = largest[np.arange(B) * S + shape[:, 0]], largest[np.arange(B) * S + np.maximum(shape[:, 1], 0)]
    present = (rel >= 0) & (a >= 0) & (b >= 0)
    relation = np.zeros(B)
    for r, name in enumerate(shapes.RELATIONS):
        m = present & (rel == r)
        relation[m] = shapes.relation_holds(name, (cx[a[m]], cy[a[m]]), (cx[b[m]], cy[b[m]]))
    credit = np.concatenate([count_credit, color_credit, relation[:, None]], 1)
    use = _CLAUSES[cat]
    strict = np.all((credit >= 1) | ~use, 1)
    score = (credit * use).sum(1) / use.sum(1)
    junk = np.bincount(np.asarray(objects["image"])[~valid], minlength=B)  # clutter: components of no shape
    return (strict & (junk == 0)).astype(np.float32), (score * 0.5**junk).astype(np.float32)


def evaluate(images: np.ndarray, specs) -> dict:
    """images [B, H, W, 3] in [-1, 1] and B prompts or specs -> {"strict" float32 [B] of 0/1, "score"
    float32 [B] in [0, 1], "detections": per image a list of {shape (None: not one of the three), color,
    center (x, y), area}}."""
    if len(images) != len(specs):
        raise ValueError(f"evaluate: {len(images)} images but {len(specs)} specs")
    objects = detect(images)
    strict, score = score_objects(objects, specs)
    detections = [[] for _ in range(len(images))]
    for i in range(objects["image"].size):
        s = int(objects["shape"][i])
        detections[objects["image"][i]].append({
            "shape": shapes.SHAPES[s] if s >= 0 else None, "color": shapes.COLORS[objects["color"][i]],
            "center": (float(objects["cx"][i]), float(objects["cy"][i])), "area": float(objects["area"][i])})
    return {"strict": strict, "score": score, "detections": detections}


def labels_to_objects(labels: list[list[dict]]) -> dict:
    """Renderer labels (per image a list of {shape, color, center, bbox}) -> the object arrays of
    `score_objects`, area = bbox area: the ground truth a pixel evaluator should reproduce."""
    flat = [(i, o) for i, objs in enumerate(labels) for o in objs]
    return dict(image=np.array([i for i, _ in flat], np.int64),
                shape=np.array([_SHAPE_ID[o["shape"]] for _, o in flat], np.int64),
                color=np.array([_COLOR_ID[o["color"]] for _, o in flat], np.int64),
                cx=np.array([o["center"][0] for _, o in flat]), cy=np.array([o["center"][1] for _, o in flat]),
                area=np.array([(o["bbox"][2] - o["bbox"][0]) * (o["bbox"][3] - o["bbox"][1]) for _, o in flat], float))


def _fields(spec: dict) -> list:
    return [v for o in spec["objects"] for v in (o["shape"], o["color"], o["count"])] + [spec["relation"]]


def near_misses(spec: dict) -> list[dict]:
    """The specs of the same category that differ from `spec` in exactly one shape, color, count or relation."""
    mine = _fields(spec)
    return [o for o in shapes.all_specs(spec["category"]) if sum(p != q for p, q in zip(mine, _fields(o))) == 1]


def validate(n_per_category: int, seed: int = 0, size: int = 32, noise: float = 0.0) -> dict:
    """Check the evaluator against the renderer: per category, n scenes rendered for random prompts
    (plus Gaussian pixel noise of std `noise`). accept = strict accuracy on the scene's own prompt;
    reject = share of strict = 0 on a near miss of it (one shape, color, count or relation changed) that
    the scene's labels do not satisfy. Returns {category: {"accept", "reject", "score_own", "score_other", "n"}}."""
    rng = np.random.default_rng(seed)
    out = {}
    for cat in shapes.CATEGORIES:
        pool = shapes.all_specs(cat)
        specs = [pool[i] for i in rng.integers(len(pool), size=n_per_category)]
        scenes = [shapes.sample_scene(s, rng, size) for s in specs]
        images, labels = np.stack([im for im, _ in scenes]), [lab for _, lab in scenes]
        images = images + noise * rng.standard_normal(images.shape).astype(np.float32)
        cands = [[m[i] for i in rng.permutation(len(m))] for m in map(near_misses, specs)]
        truth, _ = score_objects(labels_to_objects([lab for lab, c in zip(labels, cands) for _ in c]),
                                 [m for c in cands for m in c])
        starts = np.cumsum([0] + [len(c) for c in cands])
        others = [c[int(np.argmin(truth[i:j]))] for c, i, j in zip(cands, starts, starts[1:])]  # first unmet
        truth_own, _ = score_objects(labels_to_objects(labels), specs)
        truth_other, _ = score_objects(labels_to_objects(labels), others)
        if not truth_own.all() or truth_other.any():
            raise RuntimeError(f"renderer labels disagree with their prompts ({cat})")
        own, other = evaluate(images, specs), evaluate(images, others)
        out[cat] = {"accept": float(own["strict"].mean()), "reject": float(1 - other["strict"].mean()),
                    "score_own": float(own["score"].mean()), "score_other": float(other["score"].mean()),
                    "n": n_per_category}
    return out
