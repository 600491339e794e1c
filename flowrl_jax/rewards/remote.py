"""Rewards scored by a server, named in `train.rewards` like any other:

    ("remote:ocr@http://127.0.0.1:18090", 1.0)          # our server (`serve.py`, `protocol.py`): any registered reward
    ("flow_grpo:geneval@http://127.0.0.1:18085", 1.0)   # flow_grpo's reward-server: GenEval's `scores` (partial credit)
    ("flow_grpo:deqa@http://127.0.0.1:18086", 1.0)      # ... and DeQA's `outputs`

A batch goes out in requests of `batch_size` rows (`train.remote_rewards`), with `Authorization: Bearer $FLOWRL_REWARD_TOKEN`
when that is set (`serve --token`). Connection errors (a refused or dropped connection, an answer cut short) and 503
(busy) are retried with exponential backoff (0.5 s doubling to 8 s) until `deadline_s` has passed since the first
failure; anything else fails at once. Every failure is a `RewardServerError` naming the URL and the cause (an error
body's tail, where a traceback names the exception): the train loop then saves a checkpoint and stops, and the same
command resumes (`train.loop`). `retryable` says whether waiting for the server can help (main's exit status 75: a 503
past the deadline, a 504 or 408, no answer within `timeout_s`) or the request or the server must be fixed first (2: a
4xx naming a bad request, a 500 from a reward that raised, an answer that is not scores).

flow_grpo's servers speak pickle both ways. We send what they expect (a pickled dict of JPEG bytes, GenEval's
metadata rows, `only_strict`) and read the answer with `safe_loads`, an unpickler that admits plain containers,
strings and numbers only: the opcodes are scanned before anything is built, and any that could import, call or
build an object (GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, EXT, persistent ids) is refused, as is a length past the
data's end. Answers are read up to `answer_cap(rows)` bytes (64 KiB + 1 KiB a row: scores are 9 bytes each), so a
hostile answer costs at most that times pickle's or msgpack's expansion. `check_rows` refuses, when the config is
validated, prompt rows that flow_grpo's GenEval server could not read (it needs `tag`, `prompt` and `include`).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import threading
import time
from typing import Any, Callable

import numpy as np
import requests
from PIL import Image

from flowrl_jax.rewards import image, protocol

KINDS = ("remote", "flow_grpo")
FLOW_GRPO_REWARDS = ("geneval", "deqa")
DEFAULTS = dict(deadline_s=300.0, timeout_s=120.0, batch_size=64)  # train.remote_rewards
BACKOFF_S = (0.5, 8.0)  # first wait, longest wait
RETRY_LATER = (408, 504)  # the server was slow (a body, a batch): waiting may help; the run stops with exit 75
TOKEN_ENV = "FLOWRL_REWARD_TOKEN"  # serve.TOKEN_ENV (not imported: serve pulls in aiohttp's server)


def answer_cap(rows: int) -> int:
    """The largest answer read for `rows` rows: scores are 9 bytes each in msgpack or pickle, a few lists of them."""
    return (64 << 10) + (1 << 10) * rows


class RewardServerError(RuntimeError):
    """A remote reward that could not be scored; `url` names the server, `reason` what went wrong."""

    def __init__(self, url: str, reason: str, retryable: bool = True):
        super().__init__(f"reward server {url}: {reason}")
        self.url, self.reason, self.retryable = url, reason, retryable


@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str    # "remote" | "flow_grpo"
    reward: str  # the reward's name on the server
    url: str     # http://host:port


def is_remote(name: str) -> bool:
    return str(name).split(":", 1)[0] in KINDS and ":" in str(name)


def parse(name: str) -> Spec:
    """'remote:ocr@http://127.0.0.1:18090' -> Spec; ValueError naming the form when it is not one."""
    kind, _, rest = str(name).partition(":")
    reward, at, url = rest.partition("@")
    ok = kind in KINDS and at and reward and url.startswith(("http://", "https://")) and len(url.split("//", 1)[1]) > 0
    if not ok:
        raise ValueError(f"remote reward {name!r}: write it as remote:NAME@http://HOST:PORT (our server) or "
                         f"flow_grpo:{'|'.join(FLOW_GRPO_REWARDS)}@http://HOST:PORT (flow_grpo's reward-server)")
    if kind == "flow_grpo" and reward not in FLOW_GRPO_REWARDS:
        raise ValueError(f"remote reward {name!r}: flow_grpo's reward-server protocol is known for {FLOW_GRPO_REWARDS}, not {reward!r}")
    return Spec(kind, reward, url.rstrip("/"))


def settings(given: Any = None) -> dict:
    """`train.remote_rewards` merged over DEFAULTS; ValueError naming an unknown key or a non-positive value."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"train.remote_rewards has no {unknown}; its keys are {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **given}
    if min(out.values()) <= 0:
        raise ValueError(f"train.remote_rewards values must be positive, got {out}")
    return out


_SESSIONS = threading.local()  # one keep-alive session per scoring thread (a requests.Session is not thread-safe)


def post(url: str, path: str, body: bytes, content_type: str, deadline_s: float, timeout_s: float, max_answer: int) -> bytes:
    """POST `url + path` with retries on connection errors and 503 until `deadline_s` after the first failure -> the
    200 body (at most `max_answer` bytes); RewardServerError naming `url` and the cause otherwise."""
    session = getattr(_SESSIONS, "session", None) or requests.Session()
    _SESSIONS.session = session
    headers = {"Content-Type": content_type}
    if os.environ.get(TOKEN_ENV):
        headers["Authorization"] = f"Bearer {os.environ[TOKEN_ENV]}"
    first_failure, wait = None, BACKOFF_S[0]
    while True:
        try:
            with session.post(url + path, data=body, headers=headers, timeout=(min(timeout_s, 10.0), timeout_s),
                              stream=True) as response:
                answer = _read(response, url, max_answer if response.status_code == 200 else answer_cap(0))
            if response.status_code == 200:
                return answer
            if response.status_code != 503:
                hint = f"; set {TOKEN_ENV} to the server's --token" if response.status_code == 401 and TOKEN_ENV not in \
                    protocol.error_message(answer) else ""
                raise RewardServerError(url, f"HTTP {response.status_code}: {protocol.error_message(answer)}{hint}",
                                        retryable=response.status_code in RETRY_LATER)
            why = f"busy (503: {protocol.error_message(answer)})"
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            why = f"unreachable ({type(e).__name__})"
        except requests.Timeout:
            raise RewardServerError(url, f"no answer within {timeout_s:g} s (train.remote_rewards.timeout_s)") from None
        except requests.RequestException as e:
            raise RewardServerError(url, f"{type(e).__name__}: {e}", retryable=False) from None
        now = time.monotonic()
        first_failure = first_failure or now
        if now - first_failure + wait > deadline_s:
            raise RewardServerError(url, f"{why} for {now - first_failure:.0f} s, past train.remote_rewards.deadline_s={deadline_s:g}")
        time.sleep(wait)
        wait = min(2 * wait, BACKOFF_S[1])


def _read(response, url: str, cap: int) -> bytes:
    """The answer's body, refused past `cap` bytes (read in pieces: a hostile server cannot fill the memory). An error
    answer is read up to 16 `cap` and its last `cap` bytes kept: a traceback's end names the exception."""
    pieces, size, total = [], 0, 0
    for piece in response.iter_content(64 << 10):
        pieces.append(piece)
        size, total = size + len(piece), total + len(piece)
        if size > cap and response.status_code == 200:
            raise RewardServerError(url, f"the answer is over {cap} bytes, more than scores for its rows take", retryable=False)
        if size > cap:
            pieces, size = [b"".join(pieces)[-cap:]], cap
        if total > 16 * cap:
            break
    return b"".join(pieces)


def plain_rows(prompts: list) -> list:
    """Prompt rows as msgpack/pickle-safe plain data (tuples -> lists, numpy scalars -> numbers)."""
    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v
    return [plain(p) for p in prompts]


# ------------------------------------------------------------------------------------------- flow_grpo's pickle
_CODE_OPCODES = {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4",
                 "PERSID", "BINPERSID"}  # the opcodes that import, call or build objects


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # every pickle that runs code goes through here (GLOBAL / STACK_GLOBAL)
        raise pickle.UnpicklingError(f"refused: the answer names {module}.{name}; only plain containers, strings and "
                                     "numbers are accepted")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused: persistent ids are not accepted")


def safe_loads(data: bytes) -> Any:
    """pickle.loads admitting only dict/list/tuple/set/str/bytes/int/float/bool/None; UnpicklingError otherwise. The
    opcodes are scanned first (`pickletools.genops`, which builds nothing): code opcodes and any length past the data's
    end are refused before the unpickler allocates or calls anything; `find_class` refuses all as a second lock."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _CODE_OPCODES:
                raise pickle.UnpicklingError(f"refused: the answer holds opcode {op.name} (it imports or calls code); only plain "
                                             "containers, strings and numbers are accepted")
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # genops: a truncated pickle, a length past the end, an unknown opcode
        raise pickle.UnpicklingError(f"refused: not a well-formed pickle ({type(e).__name__}: {e})") from None
    return _PlainUnpickler(io.BytesIO(data)).load()


def _jpegs(pixels: np.ndarray) -> list[bytes]:
    out = []
    for picture in pixels:  # flow_grpo: PIL's JPEG at its default quality (75)
        buffer = io.BytesIO()
        Image.fromarray(picture).save(buffer, format="JPEG")
        out.append(buffer.getvalue())
    return out


def _flow_grpo_request(reward: str, pixels: np.ndarray, prompts: list) -> bytes:
    data = {"images": _jpegs(pixels)}
    if reward == "geneval":  # flow_grpo rewards.geneval_score: the dataset rows as metadata, only the strict reward in training
        data.update(meta_datas=plain_rows(prompts), only_strict=True)
    return pickle.dumps(data, protocol=4)


def _flow_grpo_scores(reward: str, answer: bytes, rows: int, url: str) -> np.ndarray:
    try:
        message = safe_loads(answer)
    except Exception as e:
        raise RewardServerError(url, f"the answer is not a plain pickle ({e})", retryable=False) from None
    key = "scores" if reward == "geneval" else "outputs"  # what flow_grpo trains on for each
    values = message.get(key) if isinstance(message, dict) else None
    if not isinstance(values, (list, tuple)) or len(values) != rows or not all(isinstance(v, (int, float)) for v in values):
        shown = sorted(map(str, message))[:10] if isinstance(message, dict) else type(message).__name__  # never str(message): a
        raise RewardServerError(url, f"the answer's {key!r} is not {rows} numbers (keys: {shown})", retryable=False)  # shared bomb
    return np.asarray(values, np.float32)


def _geneval_row_problem(row: Any) -> str | None:
    """What flow_grpo's GenEval server (reward_server/gen_eval.py) would fail on in this row, or None."""
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, not a dataset row (a map)"
    missing = [k for k in ("tag", "prompt", "include") if k not in row]
    if missing:
        return f"has no {missing}"
    if not isinstance(row["tag"], str) or not isinstance(row["prompt"], str):
        return "has a tag or prompt that is not a string"
    for key in ("include", "exclude"):
        clauses = row.get(key, [])
        if not isinstance(clauses, list):
            return f"has {key} {clauses!r}, not a list of {{class, count}} maps"
        for i, c in enumerate(clauses):
            if not (isinstance(c, dict) and isinstance(c.get("class"), str) and type(c.get("count")) is int and c["count"] > 0):
                return f"has {key}[{i}] = {c!r}; each needs a class (str) and a count (int > 0)"
            position = c.get("position") if key == "include" else None
            if position is not None and not (isinstance(position, (list, tuple)) and len(position) == 2 and
                                             type(position[1]) is int and 0 <= position[1] < i):
                return f"has include[{i}].position = {position!r}; it must be [relation, index of an earlier clause]"
    return None


def check_rows(name: str, rows) -> None:
    """ValueError naming the first prompt row that the server behind `name` could not read, and how many there are:
    flow_grpo's GenEval server indexes `tag`, `prompt` and `include` (and `exclude`) and answers a 500 at the first
    scoring otherwise; run when the config is validated, before any sampling."""
    spec = parse(name)
    if spec.kind != "flow_grpo" or spec.reward != "geneval":
        return
    rows = list(rows)
    bad = [(i, problem) for i, problem in ((i, _geneval_row_problem(r)) for i, r in enumerate(rows)) if problem]
    if bad:
        i, problem = bad[0]
        raise ValueError(f"{len(bad)} of {len(rows)} prompt rows cannot be scored by flow_grpo's GenEval server ({name}); "
                         f"row {i} {problem}; use GenEval's metadata rows (tag, prompt, include: [{{class, count}}])")


# ------------------------------------------------------------------------------------------------- the reward
def build(name: str, given: Any = None) -> Callable:
    """A host reward `(images [B, H, W, 3] in [-1, 1], prompts) -> float32 [B]` scored by the server `name` names."""
    spec, cfg = parse(name), settings(given)

    def score(pixels: np.ndarray, prompts: list) -> np.ndarray:
        if spec.kind == "remote":
            body = protocol.encode_request(pixels, plain_rows(prompts), [spec.reward])
            answer = post(spec.url, protocol.SCORE_PATH, body, protocol.CONTENT_TYPE, cfg["deadline_s"], cfg["timeout_s"],
                          answer_cap(len(prompts)))
            try:
                return protocol.decode_response(answer, [spec.reward], len(prompts))[spec.reward]
            except protocol.ProtocolError as e:
                raise RewardServerError(spec.url, str(e), retryable=False) from None
        body = _flow_grpo_request(spec.reward, pixels, prompts)
        answer = post(spec.url, "", body, "application/octet-stream", cfg["deadline_s"], cfg["timeout_s"], answer_cap(len(prompts)))
        return _flow_grpo_scores(spec.reward, answer, len(prompts), spec.url)

    def reward(images, prompts) -> np.ndarray:
        pixels, size = image.to_uint8(images), int(cfg["batch_size"])
        if len(pixels) != len(prompts):
            raise ValueError(f"{name}: {len(pixels)} images but {len(prompts)} prompts")
        parts = [score(pixels[i:i + size], list(prompts[i:i + size])) for i in range(0, len(pixels), size)]
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)

    return reward
