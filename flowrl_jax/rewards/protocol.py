"""The reward service's wire format, version 1: msgpack both ways, never pickle.

    body = encode_request(pixels, prompts, names)     # pixels uint8 [B, H, W, 3]; prompts: B str or row dicts
    request = decode_request(body, limits)            # -> Request, or ProtocolError naming the field (a 4xx)
    body = encode_response({"ocr": scores})           # scores float [B] per reward
    scores = decode_response(body, names, rows)       # -> {name: float32 [B]}, or ProtocolError

POST /v1/score takes `{"version": 1, "rewards": [names] (optional: all served), "images": IMAGES, "prompts": [...]}`
where IMAGES is `{"dtype": "uint8", "shape": [B, H, W, 3], "data": <B*H*W*3 bytes>}` (raw, row-major) or
`{"png": [<PNG bytes>, ...]}`; a prompt is a string or a map of strings to JSON-like values (a prompt dataset's row:
`prompt`, GenEval's `tag`/`include`, the shapes world's `spec`). The answer is `{"version": 1, "scores": {name: [B
floats]}}`, or `{"version": 1, "error": message}` with a 4xx/5xx status.

Every resource a request can make the server spend is bounded before it is spent (`Limits`): the body's bytes; its
msgpack objects and nesting, counted by a walk over the bytes that builds nothing (`count_objects`) before anything is
unpacked; the lengths of strings, binaries, arrays and maps; the batch; the image side; and the decoded pixels in
total (rows x height x width, known from the raw shape or the PNG headers before any pixel is decoded). msgpack
extension types (the timestamp among them) are refused. `worst_case_bytes` turns the caps into the server's memory
bound (docs/rewards.md).
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
    """What one request may hold (the server's caps: `serve --max_batch --max_body_mb --max_pixels`)."""
    max_batch: int = 256
    max_side: int = 2048            # pixels per image side
    max_pixels: int = 1 << 24       # rows x height x width decoded per request: 64 x 512 x 512, 16 x 1024 x 1024
    max_body_bytes: int = 64 << 20  # 1 << 24 pixels raw is 48 MiB
    max_depth: int = 16             # msgpack nesting: a GenEval row is 4 deep in the request

    @property
    def max_objects(self) -> int:
        """msgpack objects per request: 256 per row (a GenEval row is about 20) and 64 for the envelope."""
        return 64 + 256 * self.max_batch


OBJECT_BYTES = 128  # Python memory per unpacked msgpack object past its payload bytes: <= 73 measured (tracemalloc,
                    # CPython 3.11, msgpack 1.x: an empty dict in a list 72, a float 32, a 2-char str 59), with headroom
CONNECTION_BYTES = 512 << 10  # an open connection: asyncio's 256 KiB read, aiohttp's 2 x 64 KiB paused stream, parser


def connection_ceiling(max_connections: int) -> int:
    """The most connections the server holds open at once (`serve.Doorman`: past the cap for 0.1 s at most)."""
    return 4 * max_connections + 128


def worst_case_bytes(limits: Limits, max_pending: int, max_connections: int) -> int:
    """The server's worst-case memory above its idle footprint, not counting what the rewards themselves allocate on
    one batch (docs/rewards.md, "Bounds"): (P + 1) B + 15 M + 12 min(S^2, M) + 128 O + (4 C + 128) x 512 KiB, where P admitted
    requests each hold a body of at most B bytes, the one being scored also its unpacked copy (B) and pixels (uint8 3 M
    and the float32 images 12 M bytes for M pixels), the PNG being decoded up to 12 bytes per pixel (PIL's 4-byte
    pixels twice and the array), O msgpack objects and up to 4 C + 128 connections (C = --max_connections; past C for 0.1 s at most, serve.Doorman)."""
    B, M, S = limits.max_body_bytes, limits.max_pixels, limits.max_side
    return ((max_pending + 1) * B + 15 * M + 12 * min(S * S, M) + OBJECT_BYTES * limits.max_objects
            + connection_ceiling(max_connections) * CONNECTION_BYTES)


@dataclasses.dataclass
class Request:
    pixels: np.ndarray      # uint8 [B, H, W, 3]
    prompts: list           # B str or dict rows
    rewards: list | None    # names asked for; None: every served reward


def _refuse_ext(code, data):
    raise ProtocolError(f"msgpack extension type {code} is not part of protocol {VERSION}")


_SKIP = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4,
         0xd3: 8}                                                # nil, bools, floats, ints: payload bytes
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin, str: bytes of the length field
_ARRAYS, _MAPS = {0xdc: 2, 0xdd: 4}, {0xde: 2, 0xdf: 4}          # bytes of the count field
_EXTS = {0xc7: 1, 0xc8: 2, 0xc9: 4, 0xd4: 0, 0xd5: 0, 0xd6: 0, 0xd7: 0, 0xd8: 0}  # (the timestamp is extension -1)


def count_objects(body, limits: Limits) -> int:
    """The msgpack objects in `body`, counted by walking its bytes (msgpack spec) without building any. ProtocolError:
    413 past `limits.max_objects`, 400 past `limits.max_depth`, at an extension type, or on bytes that are not one
    whole msgpack object. Run before unpacking, so an unpacked request holds at most that many Python objects."""
    end, pos, objects, left = len(body), 0, 0, [1]  # left: items still to read in each open container
    while left:
        if not left[-1]:
            left.pop()
            continue
        left[-1] -= 1
        if pos >= end:
            raise ProtocolError(f"the body is not msgpack (it ends inside an object at byte {end}); protocol {VERSION} sends msgpack maps")
        tag, pos, objects, items = body[pos], pos + 1, objects + 1, 0
        if objects > limits.max_objects:
            raise ProtocolError(f"the body holds over {limits.max_objects} msgpack objects, the cap for a batch of "
                                f"{limits.max_batch} (256 per row); send plain rows", 413)
        if tag <= 0x7f or tag >= 0xe0:  # fixint
            continue
        if tag <= 0x8f:
            items = 2 * (tag & 0x0f)
        elif tag <= 0x9f:
            items = tag & 0x0f
        elif tag <= 0xbf:
            pos += tag & 0x1f
        elif tag in _SKIP:
            pos += _SKIP[tag]
        elif tag in _SIZED:
            n = _SIZED[tag]
            pos += n + int.from_bytes(body[pos:pos + n], "big")
        elif tag in _ARRAYS or tag in _MAPS:
            n = _ARRAYS.get(tag) or _MAPS[tag]
            items, pos = int.from_bytes(body[pos:pos + n], "big") * (1 if tag in _ARRAYS else 2), pos + n
        elif tag in _EXTS:
            code = body[pos + _EXTS[tag]:pos + _EXTS[tag] + 1]
            _refuse_ext(int.from_bytes(code, "big", signed=True) if code else "(cut short)", None)
        else:
            raise ProtocolError(f"the body is not msgpack (byte 0x{tag:02x} at {pos - 1} begins no object); protocol {VERSION} sends msgpack maps")
        if items:
            if len(left) >= limits.max_depth:
                raise ProtocolError(f"the body nests msgpack containers over {limits.max_depth} deep; prompt rows are plain data")
            left.append(items)
    if pos != end:
        raise ProtocolError(f"the body is not msgpack: one object ends at byte {pos} of {end}; protocol {VERSION} sends one map")
    return objects


def _unpack(body, limits: Limits) -> Any:
    count_objects(body, limits)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_refuse_ext, max_bin_len=limits.max_body_bytes,
                               max_str_len=1 << 20, max_array_len=max(limits.max_batch, 4096), max_map_len=4096)
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


def _check_pixels(rows: int, height: int, width: int, limits: Limits, what: str) -> None:
    if min(rows, height, width) < 1:
        raise ProtocolError(f"{what} are {rows} x {height} x {width}; every side must be at least 1")
    if rows > limits.max_batch:
        raise ProtocolError(f"a batch of {rows} images; the cap is {limits.max_batch} per request", 413)
    if max(height, width) > limits.max_side:
        raise ProtocolError(f"{what} are {height}x{width}; the cap is {limits.max_side} per side", 413)
    if rows * height * width > limits.max_pixels:  # Python ints: no overflow
        raise ProtocolError(f"{rows} images of {height}x{width} are {rows * height * width} pixels; the cap is "
                            f"{limits.max_pixels} per request (--max_pixels): send smaller batches", 413)


def _png_pixels(blobs: list, limits: Limits) -> np.ndarray:
    """uint8 [B, H, W, 3]: the sizes are read from the PNG headers and checked (sides, total pixels, one size) before
    any pixel is decoded; then each is decoded into one preallocated array (no decompression bombs)."""
    if not blobs:
        raise ProtocolError("images.png is empty; a request holds at least one image")
    sizes = []
    for i, blob in enumerate(blobs):
        if not isinstance(blob, bytes):
            raise ProtocolError(f"images.png[{i}] must be PNG bytes, got {type(blob).__name__}")
        try:
            with Image.open(io.BytesIO(blob), formats=["PNG"]) as image:  # reads the header only
                sizes.append(image.size)
        except Exception as e:
            raise ProtocolError(f"images.png[{i}] is not a readable PNG ({e})") from None
    width, height = max(w for w, _ in sizes), max(h for _, h in sizes)
    _check_pixels(len(blobs), height, width, limits, "images.png")
    if len(set(sizes)) > 1:
        raise ProtocolError(f"images.png holds images of different sizes {sorted(set(sizes))[:4]}; send one size per request")
    pixels = np.empty((len(blobs), height, width, 3), np.uint8)
    for i, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob), formats=["PNG"]) as image:
                pixels[i] = np.asarray(image.convert("RGB"))
        except Exception as e:
            raise ProtocolError(f"images.png[{i}] is not a readable PNG ({e})") from None
    return pixels


def _raw_pixels(images: dict, limits: Limits) -> np.ndarray:
    shape, data = images.get("shape"), images.get("data")
    if images.get("dtype") != "uint8":
        raise ProtocolError(f"images.dtype must be 'uint8', got {images.get('dtype')!r}")
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(d) is int and d >= 0 for d in shape) and shape[3] == 3):
        raise ProtocolError(f"images.shape must be [B, H, W, 3] (non-negative ints), got {shape!r}")
    _check_pixels(*shape[:3], limits, "images")
    if not isinstance(data, bytes) or len(data) != math.prod(shape):  # exact integers (np.prod would overflow int64)
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ProtocolError(f"images.data must be {math.prod(shape)} bytes for shape {shape}, got {size}")
    return np.frombuffer(data, np.uint8).reshape(shape)


def decode_request(body: bytes, limits: Limits = Limits()) -> Request:
    """A request body -> Request; ProtocolError (with its HTTP status) naming the first thing wrong."""
    message = _unpack(body, limits)
    if not isinstance(message, dict):
        raise ProtocolError(f"the body must be a msgpack map, got {type(message).__name__}")
    if type(message.get("version")) is not int or message.get("version") != VERSION:
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
    if not isinstance(prompts, list) or len(prompts) != pixels.shape[0]:
        raise ProtocolError(f"'prompts' must be a list of {pixels.shape[0]} prompts (one per image), got "
                            f"{len(prompts) if isinstance(prompts, list) else type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict)):
            raise ProtocolError(f"prompts[{i}] must be a string or a map (a dataset row), got {type(p).__name__}")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ProtocolError(f"'rewards' must be a list of reward names, got {str(names)[:200]}")
    return Request(pixels, prompts, None if names is None else list(dict.fromkeys(names)))  # each name scored once


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


def error_message(body: bytes, chars: int = 300) -> str:
    """The `error` of a protocol answer; for anything else (flow_grpo's traceback, a proxy's page) the last `chars` of its
    text, whitespace collapsed: a traceback ends with the exception, the part that says what happened."""
    try:
        message = msgpack.unpackb(body, raw=False, max_bin_len=0, max_str_len=4096, ext_hook=_refuse_ext)
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            return message["error"]
    except Exception:
        pass
    text = " ".join(body[-4 * chars:].decode("utf-8", "replace").split())
    return text if len(text) <= chars else "..." + text[-chars:]
