"""Prompt KV caches of frozen models, computed once and kept on disk (fuser training's memo).

While a fuser trains, the receiver and the sharer are frozen, so the prompt prefill of a
training example gives the same cache at every step and every epoch, for every control and
for every fuser sharing that model. :class:`PrefillStore` computes each prompt's cache once
(batch size 1, ``logits_to_keep=1``: the prefill's logits are never used) and keeps it as a
safetensors file::

    <root>/<model key>/<dtype>/probe.safetensors            the model's fingerprint (below)
    <root>/<model key>/<dtype>/<sha256 of the ids>.safetensors   one prompt's cache

**Invalidation.** The model key names the model version (spec and adapter hash,
:class:`edgefuse.c2c.registry.ModelVersion`), so a changed adapter reads another folder. A
wrong key must not serve stale caches either: on opening a folder the store prefills a fixed
probe prompt and compares its cache with the one kept there; on any difference the folder
is emptied (``UserWarning``) and refilled.

**Precision.** Caches are used, and kept, in ``dtype`` (``float32`` or ``float16``/``bfloat16``
to halve the disk): :func:`prefill` rounds the computed cache to it whether or not a store
is used, so cached and uncached training see bit-identical inputs.

An unreadable file is a miss (it is recomputed and rewritten); files are written atomically.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch
from safetensors.torch import load, save
from transformers import DynamicCache

from edgefuse.io import atomic_write_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PROBE_IDS = [1, 2, 3, 5, 8, 13, 21, 34]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown prefill cache dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _round(cache: DynamicCache, dtype: torch.dtype) -> DynamicCache:
    """``cache`` with its tensors rounded to ``dtype`` and back to float32, in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.to(dtype).float()
        layer.values = layer.values.to(dtype).float()
    return cache


@torch.no_grad()
def prefill(model, ids: list[int], dtype: str = "float32") -> DynamicCache:
    """The prompt cache of ``ids`` on ``model`` (batch 1), rounded to ``dtype``.

    Returns:
        A ``DynamicCache`` with float32 ``[1, H, T, D]`` keys and values per layer (a
        sliding-window layer holds the last ``window - 1`` of the ``T`` tokens).

    Raises:
        ValueError: ``ids`` is empty or ``dtype`` is unknown.
    """
    if not ids:
        raise ValueError("nothing to prefill: the prompt is empty")
    x = torch.tensor([ids], dtype=torch.long, device=_device(model))
    return _round(model(x, use_cache=True, logits_to_keep=1).cache, _dtype(dtype))


def _to_tensors(cache: DynamicCache, dtype: torch.dtype, length: int) -> dict[str, torch.Tensor]:
    out = {"length": torch.tensor([length], dtype=torch.int64)}
    for i, layer in enumerate(cache.layers):
        out[f"k{i}"] = layer.keys.detach().to("cpu", dtype).contiguous()
        out[f"v{i}"] = layer.values.detach().to("cpu", dtype).contiguous()
    return out


def _from_tensors(tensors: dict[str, torch.Tensor], model) -> DynamicCache:
    """Rebuild the cache :func:`_to_tensors` stored, with ``model``'s layer types."""
    device = _device(model)
    cache = DynamicCache(config=model.config)
    n = len(cache.layers)
    if any(f"k{i}" not in tensors or f"v{i}" not in tensors for i in range(n)) or len(tensors) != 2 * n + 1:
        raise ValueError(f"a stored cache must hold {n} layers' keys and values and its length")
    length = int(tensors["length"][0])
    for i in range(n):
        cache.update(tensors[f"k{i}"].to(device).float(), tensors[f"v{i}"].to(device).float(), i)
        layer = cache.layers[i]
        if hasattr(layer, "cumulative_length"):  # a sliding layer holds a suffix of the prompt
            layer.cumulative_length = length
    return cache


def _same(a: DynamicCache, b: DynamicCache) -> bool:
    return len(a.layers) == len(b.layers) and all(
        x.keys.shape == y.keys.shape and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(a.layers, b.layers))


class PrefillStore:
    """Prompt caches of frozen models on disk, one folder per model version and dtype.

    Args:
        root: the store's folder (created on first write).
        dtype: ``float32`` (default), ``float16`` or ``bfloat16``: the caches' precision
            (see the module docstring).

    Attributes:
        hits, misses: lookups served from disk / computed, since construction.

    Raises:
        ValueError: an unknown ``dtype``.
    """

    def __init__(self, root: str | Path, dtype: str = "float32"):
        self.root, self.dtype_name, self.dtype = Path(root), dtype, _dtype(dtype)
        self.hits = self.misses = 0
        self._checked: set[Path] = set()

    def folder(self, model_key: str) -> Path:
        """Where ``model_key``'s caches live (the key's unsafe characters replaced)."""
        safe = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in model_key)
        if not safe.strip("."):
            raise ValueError(f"model key {model_key!r} names no folder")
        return self.root / safe / self.dtype_name

    def _check(self, model, folder: Path) -> None:
        """Empty ``folder`` unless its probe cache is what ``model`` computes now."""
        if folder in self._checked:
            return
        probe = prefill(model, _PROBE_IDS, self.dtype_name)
        path = folder / "probe.safetensors"
        if path.exists():
            try:
                same = _same(_from_tensors(load(path.read_bytes()), model), probe)
            except Exception:  # noqa: BLE001 - an unreadable probe is a stale folder
                same = False
            if not same:
                warnings.warn(f"prefill caches in {folder} are from another model or adapter: "
                              "removing them", stacklevel=3)
                for old in folder.glob("*.safetensors"):
                    old.unlink(missing_ok=True)
        if not path.exists():
            atomic_write_bytes(path, save(_to_tensors(probe, self.dtype, len(_PROBE_IDS))))
        self._checked.add(folder)

    def get(self, model, model_key: str, ids: list[int]) -> DynamicCache:
        """The cache of prompt ``ids`` on ``model`` (whose version ``model_key`` names):
        read from disk, or computed by :func:`prefill` and written."""
        folder = self.folder(model_key)
        self._check(model, folder)
        digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
        path = folder / f"{digest}.safetensors"
        if path.exists():
            try:
                cache = _from_tensors(load(path.read_bytes()), model)
                if cache.get_seq_length() == len(ids):
                    self.hits += 1
                    return cache
            except Exception:  # noqa: BLE001 - an unreadable file is recomputed
                pass
        cache = prefill(model, ids, self.dtype_name)
        atomic_write_bytes(path, save(_to_tensors(cache, self.dtype, len(ids))))
        self.misses += 1
        return cache


class Prefiller:
    """The prompt caches of one frozen model version: from a :class:`PrefillStore` when one
    is given, else computed each time (:func:`prefill`, the same rounding).

    Args:
        model: the frozen model.
        key: its version's name in the store (ignored without a store).
        store: the store, or ``None``.
        dtype: the caches' precision without a store (a store uses its own).
    """

    def __init__(self, model, key: str = "", store: PrefillStore | None = None, dtype: str = "float32"):
        self.model, self.key, self.store = model, key, store
        self.dtype = store.dtype_name if store is not None else dtype
        _dtype(self.dtype)

    def __call__(self, ids: list[int]) -> DynamicCache:
        if self.store is None:
            return prefill(self.model, ids, self.dtype)
        return self.store.get(self.model, self.key, ids)


__all__ = ["PrefillStore", "Prefiller", "prefill", "DTYPES"]
