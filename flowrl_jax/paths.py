"""Workdir paths that are local folders or bucket URLs (`gs://bucket/run`, through etils.epath: `pip install gcsfs`
on a pod). `os.path.join` serves both; what differs is here: making folders, opening, renaming, and that a URL is
already absolute. Object stores have no append: `append_line` rewrites the object (metrics.jsonl is small)."""
from __future__ import annotations

import os

from etils import epath


def is_url(path: str) -> bool:
    return "://" in str(path)


def resolve(path: str) -> str:
    """An absolute local path, or the URL unchanged."""
    return str(path) if is_url(path) else os.path.abspath(path)


def makedirs(path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def exists(path: str) -> bool:
    return epath.Path(path).exists()


def open_file(path: str, mode: str = "r"):
    return epath.Path(path).open(mode)


def rename(src: str, dst: str) -> None:
    epath.Path(src).rename(dst)


def append_line(path: str, line: str) -> None:
    """Append `line` + newline: in place on a local disk, by rewriting the object at a URL."""
    if not is_url(path):
        with open(path, "a") as f:
            f.write(line + "\n")
        return
    p = epath.Path(path)
    p.write_text((p.read_text() if p.exists() else "") + line + "\n")


def kvstore_url(folder: str) -> str:
    """A tensorstore kvstore URL of a folder (ending in /): `file://` for a local one, the URL itself otherwise."""
    return (str(folder) if is_url(folder) else "file://" + os.path.abspath(folder)).rstrip("/") + "/"
