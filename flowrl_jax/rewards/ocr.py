"""The OCR reward (host): does the image show the prompt's quoted text? Flow-GRPO's formula and engine family.

    r = reward(images, prompts)     # images [B, H, W, 3] in [-1, 1], prompt rows (dicts with "prompt", or strings) -> [B] float32

Source: flow_grpo `flow_grpo/ocr.py`, `OcrScorer.__call__`. For each image and its prompt:

    target = prompt.split('"')[1]                      the text between the first pair of double quotes
    text   = "".join(lines the engine recognised with confidence > 0, in its order)
    target, text = each with spaces removed, lowercased
    d = 0 if target is a substring of text, else min(Levenshtein(text, target), len(target))
    r = 1 - d / len(target)                            in [0, 1]; an engine failure on the image: d = len(target), r = 0

Engines (`ENGINES`, factories returning `recognize(image uint8 [H, W, 3]) -> lines`, built once, lazily):
- "rapidocr" (default): `rapidocr_onnxruntime` 1.4.4, PaddleOCR's PP-OCRv4 detector and recogniser as ONNX models shipped
  inside its wheel (ch_PP-OCRv4 det/rec, Chinese + English), run by onnxruntime on the CPU: works offline.
  `pip install -r requirements-ocr.txt`.
- "paddleocr": flow_grpo's own `PaddleOCR(use_angle_cls=False, lang="en")` (the paddleocr 2.x API; it downloads its
  weights at first use). Install paddleocr 2.x and paddlepaddle yourself.
Both drop lines scored under 0.5 (PaddleOCR's drop_score, RapidOCR's text_score), then flow_grpo keeps those > 0.
The image goes to the engine as flow_grpo hands it to PaddleOCR: the RGB array, though both engines read arrays as BGR.

The prompts are checked when the dataset is validated (`check_prompts`), never mid-run.
"""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from flowrl_jax.rewards.image import to_uint8

Recognize = Callable[[np.ndarray], list]  # image uint8 [H, W, 3] -> the recognised lines (str), in the engine's order
EXAMPLE = "e.g. 'a sign that says \"hello\"'"


def _prompt(row: Any) -> str:
    return str(row["prompt"]) if isinstance(row, Mapping) else str(row)


def target_text(prompt: str) -> str:
    """The text between the first pair of double quotes in `prompt` (flow_grpo: `prompt.split('"')[1]`)."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(f"the ocr reward reads the text to render between double quotes, {EXAMPLE}; "
                         f"prompt {prompt!r} has no pair of double quotes")
    return parts[1]


def levenshtein(a: str, b: str) -> int:
    """The edit distance between `a` and `b`: the fewest single-character insertions, deletions and substitutions."""
    previous = list(range(len(b) + 1))  # row i-1 of the DP table: distances from a[:i-1] to each prefix of b
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_reward(recognized: str, target: str) -> float:
    """1 - d / len(target) (module doc), both strings without spaces and lowercased; `recognized`: the lines joined."""
    text, target = recognized.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        raise ValueError("the ocr reward's target text is empty (nothing but spaces between the double quotes)")
    distance = 0 if target in text else min(levenshtein(text, target), len(target))
    return 1.0 - distance / len(target)


def check_prompts(rows: Iterable[Any]) -> None:
    """ValueError naming the first prompt with no text between double quotes (or only spaces), and how many there are;
    rows: dicts with "prompt", or strings. Run when the dataset is validated."""
    prompts = [_prompt(row) for row in rows]
    bad = [p for p in prompts if p.count('"') < 2 or not target_text(p).replace(" ", "")]
    if bad:
        raise ValueError(f"{len(bad)} of {len(prompts)} prompts have no text between double quotes, the first: {bad[0]!r}; "
                         f"the ocr reward reads the text to render between double quotes, {EXAMPLE}; "
                         "fix or drop these prompts")


def _rapidocr() -> Recognize:
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as e:
        raise ImportError("the ocr reward's default engine needs rapidocr_onnxruntime: "
                          "pip install -r requirements-ocr.txt") from e
    engine = RapidOCR()

    def recognize(image: np.ndarray) -> list:
        result, _ = engine(image, use_cls=False)  # flow_grpo: use_angle_cls=False, ocr(img, cls=False)
        return [text for _, text, score in result or [] if score > 0]
    return recognize


def _paddleocr() -> Recognize:
    try:
        from paddleocr import PaddleOCR
    except ImportError as e:
        raise ImportError("the 'paddleocr' ocr engine needs paddleocr 2.x and paddlepaddle (pip install 'paddleocr<3' "
                          "paddlepaddle); or use the default engine 'rapidocr': pip install -r requirements-ocr.txt") from e
    version = importlib.metadata.version("paddleocr")
    if not version.startswith("2."):
        raise ImportError(f"the 'paddleocr' ocr engine calls flow_grpo's paddleocr 2.x API; paddleocr {version} is installed")
    engine = PaddleOCR(use_angle_cls=False, lang="en", show_log=False)

    def recognize(image: np.ndarray) -> list:
        result = engine.ocr(image, cls=False)
        return [text for _, (text, score) in (result[0] if result and result[0] else []) if score > 0]
    return recognize


ENGINES: dict[str, Callable[[], Recognize]] = {"rapidocr": _rapidocr, "paddleocr": _paddleocr}
_BUILT: dict[str, Recognize] = {}  # engine name -> its recognize, built once per process
_WARNED = False  # an engine failure is reported once per process


def get_engine(name: str = "rapidocr") -> Recognize:
    """The named engine's `recognize`, built at its first use."""
    if name not in ENGINES:
        raise ValueError(f"unknown ocr engine {name!r}; known: {sorted(ENGINES)}")
    if name not in _BUILT:
        _BUILT[name] = ENGINES[name]()
    return _BUILT[name]


def reward(images: np.ndarray, prompts: Sequence[Any], engine: str | Recognize = "rapidocr") -> np.ndarray:
    """images [B, H, W, 3] in [-1, 1], B prompt rows -> [B] float32 in [0, 1] (module doc); `engine`: a name in
    `ENGINES` or a `recognize` callable."""
    global _WARNED
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or len(prompts) != images.shape[0]:
        raise ValueError(f"the ocr reward takes images [B, H, W, 3] and B prompts; got {images.shape} and {len(prompts)}")
    recognize = get_engine(engine) if isinstance(engine, str) else engine
    rewards = []
    for image, row in zip(to_uint8(images), prompts):
        target = target_text(_prompt(row))
        try:
            text = "".join(recognize(np.ascontiguousarray(image)))
        except Exception as e:  # noqa: BLE001 - flow_grpo: any OCR failure is the maximal penalty
            if not _WARNED:
                print(f"flowrl_jax: ocr reward: the engine failed on an image, scored 0 ({type(e).__name__}: {e}); "
                      "further failures are scored 0 silently", file=sys.stderr)
                _WARNED = True
            rewards.append(0.0)
            continue
        rewards.append(ocr_reward(text, target))
    return np.asarray(rewards, np.float32)
