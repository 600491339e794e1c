"""The reward service's wire format, version 1: msgpack both ways, never pickle.

    body = encode_request(pixels, prompts, names)     # pixels uint8 [B, H, W, 3]; prompts: B str or row dicts
    request = decode_request(body, limits)            # -> Request, or ProtocolError naming the field (a 4xx)
    body = encode_response({"ocr": scores})           # scores float [B] per reward
    scores = decode_response(body, names, rows)       # -> {name: float32 [B]}, or ProtocolError

POST /v1/score takes `{"version": 1, "rewards": [names] (optional: all served), "images": IMAGES, "prompts": [...]}`
where IMAGES is `{"dtype": "uint8", "shape": [B, H, W, 3], "data": <B*H*W*3 bytes>}` (raw, row-major) or
`{"png": [<PNG bytes>, ...]}`; a prompt is a string or a map of strings to JSON-like values (a prompt dataset's row:
`prompt`, GenEval's `tag`/`include`, the shapes world's `spec`). The answer is `{"version": 1, "scores": {name: [B
floats]}}`, or `{"version": 1, "error": message}` with a 4xx/5xx status. Unpacking is bounded (`Limits`): lengths
of strings, binaries, arrays and maps, the batch, the image side; msgpack extension types are refused.
"""
from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import msgpack
import numpy as np
from PIL import Image

VERSION = 1
SCORE_PATH, HEALTH_PATH = "/v1/score", "/health"
CONTENT_TYPE = "application/msgpack"


class ProtocolError(ValueError):
    """A request or response that breaks the protocol; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may hold (the server's caps; `serve --max_batch --max_body_mb`)."""
    max_batch: int = 256
    max_side: int = 2048           # pixels per image side
    max_body_bytes: int = 256 << 20  # 256 x 512 x 512 x 3 uint8 is 201 MB


@dataclasses.dataclass
class Request:
    pixels: np.ndarray      # uint8 [B, H, W, 3]
    prompts: list           # B str or dict rows
    rewards: list | None    # names asked for; None: every served reward


def _refuse_ext(code, data):
    raise ProtocolError(f"msgpack extension type {code} is not part of protocol {VERSION}")


def _unpack(body: bytes, limits: Limits) -> Any:
    cap = limits.max_body_bytes
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_refuse_ext, max_bin_len=cap, max_str_len=1 << 20,
                               max_array_len=max(limits.max_batch, 4096), max_map_len=4096)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError... on garbled bytes
        raise ProtocolError(f"the body is not msgpack ({type(e).__name__}: {e}); protocol {VERSION} sends msgpack maps") from None


def encode_request(pixels: np.ndarray, prompts: list, names: list[str] | None = None) -> bytes:
    """uint8 [B, H, W, 3] pixels and their B prompts (str or JSON-like row dicts) -> a request body (raw images)."""
    pixels = np.ascontiguousarray(pixels, np.uint8)
    message = {"version": VERSION, "images": {"dtype": "uint8", "shape": list(pixels.shape), "data": pixels.tobytes()},
               "prompts": list(prompts)}
    if names is not None:
        message["rewards"] = list(names)
    return msgpack.packb(message, use_bin_type=True)


def _png_pixels(blobs: list, limits: Limits) -> np.ndarray:
    images = []
    for i, blob in enumerate(blobs):
        if not isinstance(blob, bytes):
            raise ProtocolError(f"images.png[{i}] must be PNG bytes, got {type(blob).__name__}")
        try:
            image = Image.open(io.BytesIO(blob), formats=["PNG"])
            if max(image.size) > limits.max_side:  # checked before decoding the pixels (no decompression bombs)
                raise ProtocolError(f"images.png[{i}] is {image.size[0]}x{image.size[1]}; the cap is {limits.max_side} per side", 413)
            images.append(np.asarray(image.convert("RGB")))
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(f"images.png[{i}] is not a readable PNG ({e})") from None
    if len({a.shape for a in images}) > 1:
        raise ProtocolError(f"images.png holds images of different sizes {sorted({a.shape for a in images})}; send one size per request")
    return np.stack(images) if images else np.zeros((0, 1, 1, 3), np.uint8)


def _raw_pixels(images: dict, limits: Limits) -> np.ndarray:
    shape, data = images.get("shape"), images.get("data")
    if images.get("dtype") != "uint8":
        raise ProtocolError(f"images.dtype must be 'uint8', got {images.get('dtype')!r}")
    if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(d, int) and d >= 0 for d in shape) and shape[3] == 3):
        raise ProtocolError(f"images.shape must be [B, H, W, 3] (non-negative ints), got {shape!r}")
    if shape[0] > limits.max_batch:
        raise ProtocolError(f"a batch of {shape[0]} images; the cap is {limits.max_batch} per request", 413)
    if max(shape[1], shape[2]) > limits.max_side:
        raise ProtocolError(f"images are {shape[1]}x{shape[2]}; the cap is {limits.max_side} per side", 413)
    if not isinstance(data, bytes) or len(data) != math.prod(shape):  # exact integers (np.prod would overflow int64)
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ProtocolError(f"images.data must be {math.prod(shape)} bytes for shape {shape}, got {size}")
    return np.frombuffer(data, np.uint8).reshape(shape)


def decode_request(body: bytes, limits: Limits = Limits()) -> Request:
    """A request body -> Request; ProtocolError (with its HTTP status) naming the first thing wrong."""
    message = _unpack(body, limits)
    if not isinstance(message, dict):
        raise ProtocolError(f"the body must be a msgpack map, got {type(message).__name__}")
    if message.get("version") != VERSION:
        raise ProtocolError(f"protocol version {message.get('version')!r} is not supported; this server speaks {VERSION}")
    images, prompts, names = message.get("images"), message.get("prompts"), message.get("rewards")
    if not isinstance(images, dict):
        raise ProtocolError("'images' must be a map: {dtype: 'uint8', shape: [B, H, W, 3], data: bytes} or {png: [bytes]}")
    if "png" in images:
        if not isinstance(images["png"], list) or len(images["png"]) > limits.max_batch:
            raise ProtocolError(f"images.png must be a list of at most {limits.max_batch} PNGs", 413 if isinstance(images["png"], list) else 400)
        pixels = _png_pixels(images["png"], limits)
    else:
        pixels = _raw_pixels(images, limits)
    if pixels.shape[0] > limits.max_batch:
        raise ProtocolError(f"a batch of {pixels.shape[0]} images; the cap is {limits.max_batch} per request", 413)
    if not isinstance(prompts, list) or len(prompts) != pixels.shape[0]:
        raise ProtocolError(f"'prompts' must be a list of {pixels.shape[0]} prompts (one per image), got "
                            f"{len(prompts) if isinstance(prompts, list) else type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict)):
            raise ProtocolError(f"prompts[{i}] must be a string or a map (a dataset row), got {type(p).__name__}")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ProtocolError(f"'rewards' must be a list of reward names, got {names!r}")
    return Request(pixels, prompts, names)


def encode_response(scores: dict[str, np.ndarray]) -> bytes:
    """{name: [B] scores} -> a 200 answer's body."""
    return msgpack.packb({"version": VERSION, "scores": {n: [float(v) for v in np.asarray(s).reshape(-1)] for n, s in scores.items()}})


def encode_error(message: str) -> bytes:
    """A 4xx/5xx answer's body: `{"version", "error": message}`."""
    return msgpack.packb({"version": VERSION, "error": message})


def decode_response(body: bytes, names: list[str], rows: int) -> dict[str, np.ndarray]:
    """A 200 answer -> {name: float32 [rows]} for each asked name; ProtocolError when it is not that."""
    message = _unpack(body, Limits(max_batch=max(rows, 1)))
    if not isinstance(message, dict) or message.get("version") != VERSION or not isinstance(message.get("scores"), dict):
        raise ProtocolError(f"the answer is not a protocol-{VERSION} score map: {str(message)[:200]}")
    out = {}
    for n in names:
        values = message["scores"].get(n)
        if not isinstance(values, list) or len(values) != rows or not all(isinstance(v, (int, float)) for v in values):
            raise ProtocolError(f"the answer's scores[{n!r}] is not {rows} numbers")
        out[n] = np.asarray(values, np.float32)
    return out


def error_message(body: bytes) -> str:
    """The `error` of a protocol answer, or the body's start when it is something else (a proxy's page)."""
    try:
        message = msgpack.unpackb(body, raw=False, max_bin_len=0, max_str_len=4096, ext_hook=_refuse_ext)
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            return message["error"]
    except Exception:
        pass
    return body[:200].decode("utf-8", "replace")
