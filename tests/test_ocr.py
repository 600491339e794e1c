"""The OCR reward (`rewards/ocr.py`): flow_grpo's formula on hand-computed cases, the prompt checks, and the offline
engine (rapidocr_onnxruntime's bundled PP-OCRv4 models) reading words rendered in DejaVu Sans."""
import os
import sys

import matplotlib
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from flowrl_jax.rewards import ocr


# --- the formula ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, d", [
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),  # -f, +n
    ("", "abc", 3),  # three insertions
    ("abc", "", 3),
    ("same", "same", 0),
])
def test_levenshtein_classic_pairs(a, b, d):
    assert ocr.levenshtein(a, b) == d == ocr.levenshtein(b, a)


def test_ocr_reward_hand_computed():
    # the target inside the recognised text: distance 0 -> 1 - 0/5 = 1
    assert ocr.ocr_reward("theworldhello!", "hello") == 1.0
    # one substitution in a five-letter word: 1 - 1/5 = 0.8
    assert ocr.ocr_reward("hallo", "hello") == 1 - 1 / 5  # the same float operations as the formula: equal
    # unrelated long text: Levenshtein("zzzzzzzzzzzz", "hello") = 12 > 5, capped at len("hello") = 5 -> 1 - 5/5 = 0
    assert ocr.levenshtein("zzzzzzzzzzzz", "hello") == 12
    assert ocr.ocr_reward("zzzzzzzzzzzz", "hello") == 0.0
    # nothing recognised: Levenshtein("", "hello") = 5 = len -> 0
    assert ocr.ocr_reward("", "hello") == 0.0
    # spaces and case ignored on both sides: "HeLLo  World" -> "helloworld" == target "helloworld" -> 1
    assert ocr.ocr_reward("HeLLo  World", "hello world") == 1.0
    # "Hello Wrld" -> "hellowrld" vs "helloworld" (10 letters): one deletion -> 1 - 1/10 = 0.9
    assert ocr.ocr_reward("Hello Wrld", "Hello World") == 1 - 1 / 10


def test_empty_target_is_a_value_error_not_a_division_by_zero():
    with pytest.raises(ValueError, match="empty"):
        ocr.ocr_reward("anything", "   ")


# --- the prompts --------------------------------------------------------------------------------------------------------

def test_target_text_is_between_the_first_pair_of_quotes():
    assert ocr.target_text('a sign that says "Hello World" and "more"') == "Hello World"
    with pytest.raises(ValueError, match="a photo of a cat"):
        ocr.target_text("a photo of a cat")
    with pytest.raises(ValueError, match="no pair"):
        ocr.target_text('a sign that says "hello')


def test_check_prompts_names_the_first_offender_and_counts():
    ocr.check_prompts([{"prompt": 'a sign that says "hello"'}, 'a mug with "coffee" on it'])
    rows = [{"prompt": 'a sign that says "hello"'}, {"prompt": "a photo of a cat"}, 'empty quotes " "', "a dog"]
    with pytest.raises(ValueError) as err:
        ocr.check_prompts(rows)
    message = str(err.value)
    assert "3 of 4 prompts" in message and "'a photo of a cat'" in message
    assert "between double quotes" in message and "fix or drop these prompts" in message


def test_reward_checks_shapes():
    with pytest.raises(ValueError, match="B prompts"):
        ocr.reward(np.zeros((2, 8, 8, 3), np.float32), ['"a"'], engine=lambda image: [])


# --- engines -------------------------------------------------------------------------------------------------------------

def test_engine_failure_scores_zero_and_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(ocr, "_WARNED", False)
    calls = []

    def flaky(image):
        calls.append(image.dtype)
        if len(calls) % 2:
            raise RuntimeError("boom")
        return ["hel", "lo"]  # lines joined: "hello"

    images = np.zeros((4, 8, 8, 3), np.float32)
    r = ocr.reward(images, ['"hello"'] * 4, engine=flaky)
    np.testing.assert_array_equal(r, np.array([0, 1, 0, 1], np.float32))
    assert r.dtype == np.float32 and calls == [np.uint8] * 4
    assert capsys.readouterr().err.count("engine failed") == 1


def test_images_are_quantized_like_flow_grpo():
    x = np.array([-1.0, -0.5, 0.0, 0.999, 1.0, 1.5])
    # (x + 1) * 127.5 = 0, 63.75, 127.5, 254.87, 255, 318.75 -> round, clip: 0, 64, 128 (half to even), 255, 255, 255
    np.testing.assert_array_equal(ocr.to_uint8(x), [0, 64, 128, 255, 255, 255])


def test_missing_engines_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)
    monkeypatch.setitem(sys.modules, "paddleocr", None)
    with pytest.raises(ImportError, match="pip install -r requirements-ocr.txt"):
        ocr.ENGINES["rapidocr"]()
    with pytest.raises(ImportError, match="paddleocr"):
        ocr.ENGINES["paddleocr"]()
    with pytest.raises(ValueError, match="unknown ocr engine"):
        ocr.get_engine("tesseract")


FONT = os.path.join(matplotlib.get_data_path(), "fonts/ttf/DejaVuSans.ttf")  # shipped with matplotlib


def _render(word: str, size=(384, 96), font_size=48) -> np.ndarray:
    """Black `word` centred on white -> [H, W, 3] float32 in [-1, 1] (the reward's input range)."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(FONT, font_size)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    draw.text(((size[0] - right + left) // 2 - left, (size[1] - bottom + top) // 2 - top), word, fill="black", font=font)
    return np.asarray(image, np.float32) / 127.5 - 1.0


@pytest.fixture(scope="module")
def rapidocr():
    pytest.importorskip("rapidocr_onnxruntime", reason="the OCR engine is optional: pip install -r requirements-ocr.txt")
    return ocr.get_engine("rapidocr")


def test_rapidocr_reads_the_right_word_and_a_near_miss(rapidocr):
    read = []  # what the engine read, as the formula sees it

    def recording(image):
        lines = rapidocr(image)
        read.append("".join(lines).replace(" ", "").lower())
        return lines

    images = np.stack([_render("flower"), _render("flawer"), _render("Hello World")])
    r = ocr.reward(images, [{"prompt": 'a sign that says "flower"'}] * 2 + ['a neon sign "hello world"'], engine=recording)
    assert read == ["flower", "flawer", "helloworld"]
    # "flower": exact -> 1; "flawer" vs "flower": one substitution (a -> o) in 6 letters -> 1 - 1/6
    # exact: ocr.reward computes 1 - d / len in Python floats and stores it as float32, as this expected value is made
    np.testing.assert_array_equal(r, np.float32([1.0, 1.0 - 1.0 / 6.0, 1.0]))


def test_rapidocr_blank_image_scores_zero(rapidocr):
    images = np.stack([_render("flower"), np.ones((96, 384, 3), np.float32)])  # the second: all white
    assert rapidocr(ocr.to_uint8(images[1])) == []
    # nothing read: Levenshtein("", "flower") = 6 = len -> 1 - 6/6 = 0
    np.testing.assert_array_equal(ocr.reward(images, ['"flower"', '"flower"']), np.array([1.0, 0.0], np.float32))
