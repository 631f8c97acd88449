"""Prompt KV caches of frozen models, computed once and kept on disk (fuser training's memo).

While a fuser trains, the receiver and the sharer are frozen, so the prompt prefill of a
training example gives the same cache at every step and every epoch, for every control and
for every fuser sharing that model. :class:`PrefillStore` computes each prompt's cache once
(batch size 1, ``logits_to_keep=1``: the prefill's logits are never used) and keeps it as a
safetensors file::

    <root>/<model key>/<dtype>/probe.safetensors            the model's fingerprint (below)
    <root>/<model key>/<dtype>/<sha256 of the ids>.safetensors   one prompt's cache
    <root>/examples/<sha256 of rows, tokenizers, max_seq_len>.json   tokenized pairs + alignments

**Invalidation.** The model key names the model version (spec and adapter hash,
:class:`edgefuse.c2c.registry.ModelVersion`), so a changed adapter reads another folder. A
wrong key must not serve stale caches either: on opening a folder the store prefills a fixed
probe prompt and compares its cache with the one kept there; on any difference the folder
is emptied (``UserWarning``) and refilled.

**Precision.** Caches are used, and kept, in ``dtype`` (``float32`` or ``float16``/``bfloat16``
to halve the disk): :func:`prefill` rounds the computed cache to it whether or not a store
is used, so cached and uncached training see bit-identical inputs.

A file that is unreadable, or whose tensors are not what this model's cache of this prompt
is (names, ``[1, H, T, D]`` shapes per layer, the store's dtype, the prompt's length), is a
miss: it is recomputed and rewritten. The store does not check a well-formed file's values
(only the probe is recomputed): its folder must be writable by the server alone. Files are
written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import json
import warnings
import weakref
from pathlib import Path
from urllib.parse import quote

import torch
from safetensors.torch import load, save
from transformers import DynamicCache

from edgefuse.io import atomic_write_bytes

from .examples import PairExample, build_pair_examples

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PROBE_IDS = [1, 2, 3, 5, 8, 13, 21, 34]
_HEADER_BYTES = 64 * 1024  # a cache file's safetensors header and alignment, at most


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


def _expected(model, probe: DynamicCache, length: int, dtype: torch.dtype) -> dict[str, tuple]:
    """``name -> (shape, dtype)`` of the tensors :func:`_to_tensors` writes for a ``length``-token
    prompt on ``model``: per layer ``[1, H, T, D]`` with ``H, D`` the probe's and ``T`` the
    prompt's length, or ``min(length, window - 1)`` on a sliding-window layer."""
    out = {"length": ((1,), torch.int64)}
    for i, (layer, ref) in enumerate(zip(DynamicCache(config=model.config).layers, probe.layers)):
        window = getattr(layer, "sliding_window", None)
        t = min(length, window - 1) if window else length
        out[f"k{i}"] = ((1, ref.keys.shape[1], t, ref.keys.shape[3]), dtype)
        out[f"v{i}"] = ((1, ref.values.shape[1], t, ref.values.shape[3]), dtype)
    return out


def _check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], length: int) -> None:
    """Raise ``ValueError`` unless ``tensors`` are exactly ``expected`` (names, shapes, dtypes)
    and declare ``length`` tokens."""
    if set(tensors) != set(expected):
        raise ValueError(f"a stored cache holds {sorted(tensors)[:4]}..., not {sorted(expected)[:4]}...")
    for name, (shape, dtype) in expected.items():
        if tuple(tensors[name].shape) != shape or tensors[name].dtype != dtype:
            raise ValueError(f"stored {name} is {tensors[name].dtype} {tuple(tensors[name].shape)}, "
                             f"not {dtype} {shape}")
    if int(tensors["length"][0]) != length:
        raise ValueError(f"a stored cache of {int(tensors['length'][0])} tokens, not {length}")


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
        self._checked: dict[Path, tuple[weakref.ref, DynamicCache]] = {}  # folder -> (model, probe)

    def folder(self, model_key: str) -> Path:
        """Where ``model_key``'s caches live: one folder per key, its name the key
        percent-encoded (injective: two keys never share a folder; a leading ``.`` is
        encoded too, so no key names a hidden or parent folder).

        Raises:
            ValueError: an empty key.
        """
        if not model_key:
            raise ValueError("an empty model key names no folder")
        safe = quote(model_key, safe="@")
        return self.root / ("%2E" + safe[1:] if safe.startswith(".") else safe) / self.dtype_name

    def _check(self, model, folder: Path) -> DynamicCache:
        """Empty ``folder`` unless its probe cache is what ``model`` computes now (once per
        folder and model object: another model under the same key is probed again).
        Returns the probe cache."""
        seen = self._checked.get(folder)
        if seen is not None and seen[0]() is model:
            return seen[1]
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
        self._checked[folder] = (weakref.ref(model), probe)
        return probe

    def get(self, model, model_key: str, ids: list[int]) -> DynamicCache:
        """The cache of prompt ``ids`` on ``model`` (whose version ``model_key`` names):
        read from disk (when the file's tensors are what this model and prompt give:
        :func:`_check_tensors`), or computed by :func:`prefill` and written."""
        folder = self.folder(model_key)
        probe = self._check(model, folder)
        digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
        path = folder / f"{digest}.safetensors"
        if path.exists():
            try:
                expected = _expected(model, probe, len(ids), self.dtype)
                bound = _HEADER_BYTES + sum(math.prod(shape) * dtype.itemsize for shape, dtype in expected.values())
                if path.stat().st_size > bound:  # never read a file larger than this cache can be
                    raise ValueError(f"{path} is larger than a cache of {len(ids)} tokens")
                tensors = load(path.read_bytes())
                _check_tensors(tensors, expected, len(ids))
                cache = _from_tensors(tensors, model)
                if cache.get_seq_length() == len(ids):
                    self.hits += 1
                    return cache
            except Exception:  # noqa: BLE001 - an unreadable file is recomputed
                pass
        cache = prefill(model, ids, self.dtype_name)
        atomic_write_bytes(path, save(_to_tensors(cache, self.dtype, len(ids))))
        self.misses += 1
        return cache

    def pair_examples(self, rows: list[dict], receiver_tok, sharer_tok, max_seq_len: int) -> list[PairExample]:
        """:func:`edgefuse.c2c.examples.build_pair_examples` of ``rows``, kept on disk (the
        tokenizations and token alignments), keyed by the rows, both tokenizers'
        :func:`tokenizer_digest` and ``max_seq_len``; an unreadable file is rebuilt."""
        path = self.root / "examples" / f"{_examples_key(rows, receiver_tok, sharer_tok, max_seq_len)}.json"
        if path.exists():
            cached = _read_examples(path)
            if cached is not None:
                return cached
        built = build_pair_examples(rows, receiver_tok, sharer_tok, max_seq_len)
        atomic_write_bytes(path, json.dumps([dataclasses.asdict(ex) for ex in built]).encode())
        return built


def tokenizer_digest(tok) -> str:
    """sha256 (hex) of what decides a tokenization: the fast tokenizer's serialized state,
    the chat template and the special tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    parts = [backend.to_str() if backend is not None else type(tok).__name__,
             str(getattr(tok, "chat_template", None)), json.dumps(tok.special_tokens_map, sort_keys=True,
                                                                   default=str)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _examples_key(rows: list[dict], receiver_tok, sharer_tok, max_seq_len: int) -> str:
    text = json.dumps({"format": 1, "max_seq_len": int(max_seq_len),
                       "receiver": tokenizer_digest(receiver_tok), "sharer": tokenizer_digest(sharer_tok),
                       "rows": [[r.get("instruction"), r.get("context"), r.get("response")] for r in rows]},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_examples(path: Path) -> list[PairExample] | None:
    try:
        data = json.loads(path.read_text())
        names = [f.name for f in dataclasses.fields(PairExample)]
        out = []
        for d in data:
            if sorted(d) != sorted(names) or not all(isinstance(d[n], list) for n in names):
                return None
            out.append(PairExample(**{n: d[n] for n in names}))
        return out
    except Exception:  # noqa: BLE001 - an unreadable file is rebuilt
        return None


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


__all__ = ["PrefillStore", "Prefiller", "prefill", "tokenizer_digest", "DTYPES"]
