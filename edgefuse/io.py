"""Atomic file writes and strict JSON: the one place every layer writes files through.

A reader of a file written here sees either the old file or the new one, never half: data
goes to a temporary file in the same folder, is fsynced, then ``os.replace``d into place.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically; create the parent folder if needed.

    ``mode``: the file's permission bits (e.g. ``0o600`` for a private key; the data is never
    readable under wider bits, since the temporary file is made 0600). None keeps the mode
    of a file it replaces, and gives a new file 0644."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:  # keep the mode of a file we replace; new files get 0644 (mkstemp makes 0600)
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # Persist the rename itself; not possible on every platform, so best effort.
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


@contextlib.contextmanager
def atomic_write_dir(path: str | os.PathLike):
    """Build a folder in a temporary sibling, then swap it into place at ``path``.

    Yields the temporary folder to fill. On success an existing ``path`` is moved aside,
    the new folder renamed in and the old one deleted (each rename atomic; a directory
    cannot replace a non-empty one in a single step). On any error the temporary folder is
    removed and the old ``path`` is left (or put back) as it was.
    """
    import shutil
    import uuid

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, replace).

    Returns the path written.
    """
    return atomic_write_bytes(path, text.encode(encoding))


def to_jsonable(obj: Any) -> Any:
    """Deep copy of ``obj`` that strict JSON can hold.

    NaN and +-Inf floats become ``None``; tuples become lists; paths become strings;
    numpy/torch values (anything with ``tolist``) become Python numbers or lists.
    Other unknown objects are returned unchanged, so ``json.dumps`` rejects them.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, Mapping):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist())
    return obj


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (NaN/Inf as null) to ``path`` atomically.

    The whole document is serialised before any file is touched, so an object JSON
    cannot hold raises ``TypeError`` and leaves an existing file intact.
    """
    text = json.dumps(to_jsonable(obj), indent=2, allow_nan=False, ensure_ascii=False)
    return atomic_write_text(path, text + "\n")
