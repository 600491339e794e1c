"""Exact programmatic evaluator of the embedded shapes world: GenEval-style strict accuracy and Flow-GRPO
partial credit, computed from pixels alone.

`evaluate(images [B, H, W, 3] in [-1, 1], specs (B prompts or spec dicts))` ->
`{"strict": float [B] of 0/1, "score": float [B] in [0, 1], "detections": per image a list of
{shape, color, center (x, y), area}}`.

Detection (NumPy and scipy.ndimage, vectorized over chunks of the batch):
1. Color: every pixel p is explained as a mix `bg + a (c - bg)` of the background and one palette color c
   (the color whose bg-c segment is nearest). It is an object pixel of c when it is closer to c than to
   the background (a > 1/2) and its distance to that segment is at most `MAX_HUE_SIN` |p - bg| (a hue
   within ~14 degrees of c's: white, gray or in-between hues such as orange belong to no color).
   Anti-aliased edge pixels (a <= 1/2) form no object. Pixels exactly of the background color (a = 0,
   no color) are skipped: the arithmetic runs on the others only.
2. Objects: 8-connected components of object pixels of one color (`scipy.ndimage.label` of all object
   pixels, each color labelled apart where pixels of two colors touch); components under 3 px at 32x32
   (scaled with the image area) are dropped. Each component also takes the adjacent edge pixels of its
   color (of several such components, the last in raster order); every pixel is weighted by its coverage a.
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
from scipy import ndimage

from flowrl_jax.data import shapes

MAX_HUE_SIN = 0.25
MIN_COMPONENT_PX = 3.0  # at 32x32
_CHUNK_PX = 2 ** 18  # `detect` takes ~this many pixels at a time: its temporaries (<= 4 MB) stay in the CPU
# caches, 1.4x (rendered scenes) to 2.8x (noisy 64x64) faster than a batch of 1,000 images at once
_SHAPE_ID = {s: i for i, s in enumerate(shapes.SHAPES)}
_COLOR_ID = {c: i for i, c in enumerate(shapes.COLORS)}
_REL_ID = {r: i for i, r in enumerate(shapes.RELATIONS)}
_CAT_ID = {c: i for i, c in enumerate(shapes.CATEGORIES)}
_NEIGHBORS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


def _colored(images: np.ndarray):
    """images float32 [B, H, W, 3] -> the pixels that are not exactly the background color: (flat index into
    [B, H, W], increasing; color id int, -1 = none; coverage a float32). Every other pixel has d = p - bg = 0,
    hence no color and coverage 0. Step 1 of the module docstring."""
    bg = shapes.to_unit(shapes.BACKGROUND)
    v = np.stack([shapes.to_unit(shapes.PALETTE[c]) - bg for c in shapes.COLORS])  # [K, 3]
    vv = (v * v).sum(1)
    flat = images.reshape(-1, 3)
    idx = np.flatnonzero((flat[:, 0] != bg[0]) | (flat[:, 1] != bg[1]) | (flat[:, 2] != bg[2]))
    m = len(idx)
    # in blocks of 256 pixels (the last one padded with copies of pixel 0): rows of 768 floats for the arithmetic,
    # and d . v by one small BLAS gemm per block: single-threaded (one large gemm wakes BLAS threads, slow when the
    # cores are busy) and every pixel through the same kernel (BLAS rounds a single row, gemv, and some remainder
    # rows differently)
    d = np.take(flat, np.r_[idx, np.zeros(-m % 256, np.intp)], 0).reshape(-1, 256 * 3)
    d = np.clip(d, -1.0, 1.0) - np.tile(bg, 256)
    dv = np.ascontiguousarray((d.reshape(-1, 256, 3) @ v.T).reshape(-1, len(v))[:m].T)  # [K, M]
    d = d.reshape(-1, 3)[:m]
    dd = d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1] + d[:, 2] * d[:, 2]
    a = np.clip(dv / vv[:, None], 0.0, 1.0)
    resid = dd - 2 * a * dv + a * a * vv[:, None]  # |d - a v|^2
    k, best = np.zeros(m, np.int8), resid[0]
    for j in range(1, len(v)):  # the nearest color: least residual, the first on a tie
        k = np.maximum(k, (resid[j] < best) * np.int8(j))
        best = np.minimum(best, resid[j])
    alpha = np.take(a.reshape(-1), k.astype(np.intp) * m + np.arange(m))
    ok = best <= (MAX_HUE_SIN ** 2) * dd
    return idx, np.where(ok & (alpha > 0), k, -1), alpha


def segment(images: np.ndarray):
    """images [B, H, W, 3] in [-1, 1] (clipped to it) -> (color id int [B, H, W], -1 where no palette
    color explains the pixel; coverage a float32 [B, H, W] of that color). Step 1 of the module docstring."""
    images = np.asarray(images, np.float32)
    idx, k, alpha = _colored(images)
    code, cover = np.full(images.shape[:3], -1, np.int64), np.zeros(images.shape[:3], np.float32)
    code.flat[idx], cover.flat[idx] = k, alpha
    return code, cover


def _components(code: np.ndarray) -> tuple[np.ndarray, int]:
    """code int [H, W] (-1 = none) -> (labels int32 [H, W], 0 = none, 1..n numbered in raster order of the
    components' first pixels; n): the 8-connected components of pixels of equal code."""
    if code.size == 0:
        return np.zeros(code.shape, np.int32), 0
    eight = np.ones((3, 3), bool)
    labels, n = ndimage.label(code >= 0, eight)  # scipy numbers them in raster order of their first pixels
    on = np.flatnonzero(code >= 0)
    lab, c = labels.reshape(-1)[on], code.reshape(-1)[on]
    any_code = np.zeros(n + 1, c.dtype)
    any_code[lab] = c
    if np.array_equal(any_code[lab], c):  # no component joins 8-adjacent pixels of different colors
        return labels, n
    # label each color apart; number the components in raster order of their first pixels: the pixels whose label
    # exceeds every earlier label of their color (scipy numbers each color's components in raster order too)
    parts, first = [], np.zeros(len(on), bool)
    for k in np.unique(c):
        sel = np.flatnonzero(c == k)
        lab = ndimage.label(code == k, eight)[0].reshape(-1)[on[sel]]
        first[sel] = lab > np.maximum.accumulate(np.r_[0, lab[:-1]])
        parts.append((sel, lab))
    rank = np.cumsum(first, dtype=np.int32)  # at a first pixel: the number of its component
    number = np.empty(len(on), np.int32)
    for sel, lab in parts:
        of_label = np.zeros(lab.max() + 1, np.int32)
        of_label[lab[first[sel]]] = rank[sel[first[sel]]]
        number[sel] = of_label[lab]
    labels = np.zeros(code.shape, np.int32)
    labels.reshape(-1)[on] = number
    return labels, int(rank[-1])


def _powers(o, x, size, center, exponents):
    """[(x + 0.5 - center[o]) ** e for e in exponents] (x int in [0, size)), the same floats from one np.power per
    (object, x) that occurs rather than per pixel (np.power costs ~60 ns a value)."""
    key = o * size + x
    used = np.zeros(len(center) * size, bool)
    used[key] = True
    pair = np.flatnonzero(used)
    t = pair % size + 0.5 - center[pair // size]
    slot = (np.cumsum(used) - 1)[key]
    return [(t ** e)[slot] for e in exponents]


def detect(images: np.ndarray) -> dict:
    """images [B, H, W, 3] -> objects: dict of arrays [N] {image, shape (id into shapes.SHAPES, -1 = none
    of them), color (id into shapes.COLORS), cx, cy, area (coverage-weighted px), skew, corners, aspect,
    compact}, ordered by image, then by first pixel in raster order. Steps 2-3 of the module docstring."""
    images = np.asarray(images, np.float32)
    B, H, W, _ = images.shape
    step = max(1, _CHUNK_PX // (H * W))
    parts = [_detect(images[i:i + step]) for i in range(0, max(B, 1), step)]
    for i, part in zip(range(0, B, step), parts):
        part["image"] += i
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def _detect(images: np.ndarray) -> dict:
    """`detect` of a float32 batch, all at once."""
    B, H, W, _ = images.shape
    idx, code, alpha = _colored(images)
    on = np.flatnonzero(code >= 0)
    idx, code, alpha = idx[on], code[on], alpha[on]  # the pixels of a color, raster order
    r, x = np.divmod(idx, W)
    b, y = np.divmod(r, H)
    pos = (r + 2 * b + 1) * (W + 2) + x + 1  # index into [B, H + 2, W + 2]: a border of no color around each image
    grid = np.full((B, H + 2, W + 2), -1, np.int8)
    core = alpha > 0.5
    grid.reshape(-1)[pos[core]] = code[core]
    labels, n = _components(grid.reshape(B * (H + 2), W + 2))  # the borders keep every component in one image
    lab = labels.reshape(-1)[pos]  # 0 for edge pixels (a <= 1/2)
    keep = np.bincount(lab, minlength=n + 1) >= MIN_COMPONENT_PX * H * W / 1024
    keep[0] = False  # label 0: no component
    renumber = np.where(keep, np.cumsum(keep) - 1, -1)  # drop small components, number the rest 0..n-1
    comp, n = renumber[lab], int(keep.sum())
    # edge pixels (a <= 1/2, or in a dropped component) join the adjacent component of their color with the
    # largest id
    edge = np.flatnonzero(comp < 0)
    nb = np.array([dy * (W + 2) + dx for dy, dx in _NEIGHBORS])[:, None] + pos[edge]  # [8, E]
    nb_comp = renumber[labels.reshape(-1)[nb]]
    comp[edge] = np.where(grid.reshape(-1)[nb] == code[edge], nb_comp, -1).max(0)
    sel = comp >= 0
    o, b, y, x = comp[sel], b[sel], y[sel], x[sel]
    w = np.minimum(alpha[sel], 1.0).astype(np.float64)
    area = np.bincount(o, w, n)
    cx = np.bincount(o, w * (x + 0.5), n) / area
    cy = np.bincount(o, w * (y + 0.5), n) / area
    u, v = x + 0.5 - cx[o], y + 0.5 - cy[o]
    u2, v2 = u ** 2, v ** 2
    (u4,), (v3, v4) = _powers(o, x, W, cx, (4,)), _powers(o, y, H, cy, (3, 4))
    mom = lambda t: np.bincount(o, t, n) / area
    m20, m02 = mom(w * u2), np.maximum(mom(w * v2), 1e-12)
    skew = mom(w * v3) / m02 ** 1.5
    corners = (mom(w * u4) + mom(w * v4) - 6 * mom(w * u2 * v2)) / (m20 + m02) ** 2
    aspect = np.sqrt(m20 / m02)
    compact = area / np.sqrt(np.maximum(m20 * m02, 1e-12)) / 12
    image, color = np.zeros(n, np.int64), np.zeros(n, np.int64)
    image[o], color[o] = b, code[sel]  # constant within a component
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
    names = (*shapes.SHAPES, None)  # shape -1: None
    for i, s, c, x, y, a in zip(*(objects[k].tolist() for k in ("image", "shape", "color", "cx", "cy", "area"))):
        detections[i].append({"shape": names[s], "color": shapes.COLORS[c], "center": (x, y), "area": a})
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
