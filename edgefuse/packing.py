"""Wire format for many named float tensors: a few flat float32 arrays + a JSON index.

Flower's ``ArrayRecord`` sends every array separately, so hundreds of small tensors (LoRA
A/B matrices, fuser weights) are slow; a handful of flat arrays are not. LoRA adapters
use two parts (``lora_A``, ``lora_B``, see :mod:`edgefuse.lora`), fusers one
(:mod:`edgefuse.c2c.registry`).

Index: a JSON list of ``{"key", "shape", "part", "offset", "size"}``, offsets and sizes in
elements of the part's flat array; within a part, tensors are concatenated in sorted key
order and tile the array exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence

import numpy as np

ENTRY_FIELDS = {"key", "shape", "part", "offset", "size"}


def _as_float32(key: str, value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().float().numpy()
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"{key!r} has dtype {value.dtype}: only float tensors pack")
    return np.asarray(value, dtype=np.float32)  # keeps 0-d shapes (ascontiguousarray would not)


def pack(state: dict, part_of: Callable[[str], str], parts: Sequence[str]) -> tuple[dict[str, np.ndarray], str]:
    """Pack ``state`` (numpy arrays or torch tensors, float) into one flat array per part.

    Args:
        part_of: key -> the part it travels in (one of ``parts``).
        parts: every part name; an empty part is a 0-length array.

    Returns:
        ``({part: 1-D float32}, index_json)``.

    Raises:
        ValueError: a non-float tensor, or a key mapped to an unknown part.
    """
    chunks: dict[str, list[np.ndarray]] = {p: [] for p in parts}
    offsets = dict.fromkeys(parts, 0)
    index = []
    for key in sorted(state):
        part = part_of(key)
        if part not in chunks:
            raise ValueError(f"{key!r} maps to unknown part {part!r}; parts: {list(parts)}")
        value = _as_float32(key, state[key])
        index.append({"key": key, "shape": list(value.shape), "part": part,
                      "offset": offsets[part], "size": int(value.size)})
        chunks[part].append(value.ravel())
        offsets[part] += value.size
    arrays = {p: np.concatenate(c) if c else np.zeros(0, np.float32) for p, c in chunks.items()}
    return arrays, json.dumps(index, separators=(",", ":"))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def unpack(
    arrays: dict[str, np.ndarray],
    index_json: str,
    parts: Sequence[str],
    error: type[Exception] = ValueError,
    part_of: Callable[[str], str] | None = None,
    require_finite: bool = False,
) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack`; float32 copies. Arrays not named in ``parts`` are ignored.

    Untrusted input: everything is checked before a tensor is built.

    Args:
        error: the exception type to raise (callers pick their domain's error).
        part_of: when given, each key's part must equal ``part_of(key)``.
        require_finite: reject NaN/Inf values.

    Raises:
        error: an index that is not a JSON list of well-formed entries, a missing part or
            one that is not a 1-D float array, an empty or repeated key, a key in the wrong
            part, a bad shape/offset/size, a size that is not the shape's product, an entry
            out of bounds, entries that do not tile their part exactly (gap, overlap, sizes
            not adding up), or (``require_finite``) NaN/Inf values.
    """
    try:
        index = json.loads(index_json)
    except (TypeError, ValueError) as e:
        raise error(f"index is not valid JSON: {e}") from None
    if not isinstance(index, list):
        raise error("index must be a JSON list")
    flat = {}
    for part in parts:
        a = arrays.get(part) if isinstance(arrays, dict) else None
        if a is None:
            raise error(f"missing packed part {part!r}")
        if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.floating) or a.ndim != 1:
            raise error(f"packed part {part!r} must be a 1-D float array")
        if require_finite and not np.isfinite(a).all():
            raise error(f"packed part {part!r} holds NaN or Inf values")
        flat[part] = a
    state: dict[str, np.ndarray] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {p: [] for p in parts}
    for i, e in enumerate(index):
        if not isinstance(e, dict) or set(e) != ENTRY_FIELDS:
            raise error(f"index entry {i} lacks or adds fields: expected exactly {sorted(ENTRY_FIELDS)}")
        key, shape, part, off, size = e["key"], e["shape"], e["part"], e["offset"], e["size"]
        if not isinstance(key, str) or not key or part not in flat:
            raise error(f"index entry {i}: bad key or part {part!r}")
        if part_of is not None and part_of(key) != part:
            raise error(f"index entry {i}: key {key} is not in part {part}")
        if key in state:
            raise error(f"index entry {i}: repeated key {key}")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                and _is_int(off) and _is_int(size) and off >= 0 and size >= 0):
            raise error(f"index entry {i} ({key}): bad shape/offset/size")
        if math.prod(shape) != size:
            raise error(f"index entry {i} ({key}): size {size} != prod{tuple(shape)}")
        if off + size > flat[part].size:
            raise error(f"index entry {i} ({key}): [{off}, {off + size}) is out of bounds of "
                        f"{part} (length {flat[part].size})")
        state[key] = flat[part][off:off + size].astype(np.float32).reshape(shape)
        spans[part].append((off, size, key))
    for part, entries in spans.items():
        end = 0
        for off, size, key in sorted(entries):
            if off != end:
                raise error(f"{part}: {key} starts at {off}, expected {end} (gap or overlap)")
            end += size
        if end != flat[part].size:
            raise error(f"{part}: index sizes add up to {end}, array has {flat[part].size} elements")
    return state
