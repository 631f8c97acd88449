"""Vocabulary masks and the split head's downlink.

With a split head the device holds the first ``s`` columns of the target's LM head
``W [V, D]`` and the cloud the rest, so a token's logit is the sum of two partial logits::

    z(x) = h[:s] · W[x, :s]  +  h[s:] · W[x, s:]  =  z_end(x) + z_cloud(x)

The cloud computes ``z_cloud`` only over a **vocabulary mask** ``S`` (sorted token ids) and
sends it back 8-bit: the whole subset, or its top-k within the subset. The device adds its
own ``z_end`` and decodes over ``S`` only (:func:`fuse_split_head`); tokens outside ``S`` are
never emitted. In top-k mode a mask token the cloud did not send is scored at ``z_end`` + the
row's smallest sent value (``fill="bound"``, an upper bound of its true logit) or left out
(``fill="drop"``).

Masks (:func:`vocab_mask`), from the decoded string of each single token:

* ``full`` — every id ``0 .. V-1`` (the split head without a mask);
* ``english`` — ASCII letters, digits, whitespace (space, tab, newline, carriage return)
  and common punctuation ``!"#$%&'()*+,-./:;=?@[]`` only;
* ``ascii`` — any printable ASCII (0x20-0x7e) and those whitespace characters (for code);
* ``explicit`` (:data:`EXPLICIT`) — a given id set, sent to the cloud as a bitmap
  (:func:`mask_to_bitmap`).

A token that decodes to an empty string or to a partial UTF-8 sequence (the replacement
character U+FFFD) fails both filters; tokens added to the tokenizer after training
(``added_tokens_decoder``) are left out unless special. The tokenizer's special tokens and
its EOS token are always in every mask, so a masked session can always end.

Masked partial-logit codec (cloud → device, :func:`encode_masked` / :func:`decode_masked`),
little-endian, no header (the device knows ``n``, ``|S|`` and ``k`` from its own request;
the length is checked exactly against them before anything is read)::

    k = 0 (the whole subset):  lo f16[n] ‖ scale f16[n] ‖ q u8[n, |S|]           n·(4 + |S|) B
    k >= 1 (top-k in subset):  lo f16[n] ‖ scale f16[n] ‖ idx u32[n, k] ‖ q u8[n, k]  n·(4 + 5k) B

A value is ``lo + q · scale`` (float32); ``idx`` are positions in ``S`` (not token ids),
distinct within a row. Per row ``lo`` is rounded down and ``scale`` up to float16 so every
quantized value is within ``scale / 2`` of the original: ``|z - ẑ| <= scale / 2`` (plus
float32 rounding of ``lo + q·scale``). Full 8-bit logits over the whole vocabulary cost
``n · (V + 4)`` bytes in the same format (:func:`full_logits_nbytes`), the reference of
:func:`downlink_per_token`.
"""

from __future__ import annotations

import string
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from edgefuse.cloud.target import tokenizer_fingerprint

MASK_NAMES = ("full", "english", "ascii")
EXPLICIT = "explicit"
WHITESPACE = " \t\n\r"
ENGLISH_CHARS = frozenset(string.ascii_letters + string.digits + WHITESPACE + "!\"#$%&'()*+,-./:;=?@[]")
ASCII_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) | frozenset(WHITESPACE)
MAX_VOCAB = 1 << 24  # any real tokenizer is far below; bounds a bitmap's V
_F16_MAX = float(np.finfo(np.float16).max)
_HALF = np.dtype("<f2")
_U32 = np.dtype("<u4")

FILLS = ("bound", "drop")
_CACHE: dict[tuple[str, str, int], np.ndarray] = {}
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------ masks

def _vocab_size(tok, vocab_size: int | None) -> int:
    v = len(tok) if vocab_size is None else vocab_size
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be an int in 1..{MAX_VOCAB}, got {v!r}")
    return v


def special_ids(tok) -> list[int]:
    """The ids every mask holds: the tokenizer's special tokens and its EOS token."""
    ids = set(int(i) for i in tok.all_special_ids)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def as_mask(ids, vocab_size: int) -> np.ndarray:
    """``ids`` as a mask over ``vocab_size`` tokens: ``int64`` sorted unique ids.

    Raises ``ValueError``: not integers, an id outside ``0 .. vocab_size-1``, or empty."""
    a = np.asarray(ids)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"a mask is a 1-D array of integer token ids, got {a.dtype} shape {a.shape}")
    if not (a.dtype == np.int64 and a.size and np.all(a[1:] > a[:-1])):  # else already a mask
        a = np.unique(a.astype(np.int64))
    if a.size == 0:
        raise ValueError("a mask must hold at least one token id")
    if a[0] < 0 or a[-1] >= vocab_size:
        raise ValueError(f"mask id outside the vocabulary 0..{vocab_size - 1}: {int(a[0] if a[0] < 0 else a[-1])}")
    return a


def vocab_mask(tok, name: str, vocab_size: int | None = None, ids=None) -> np.ndarray:
    """The mask ``name`` (one of :data:`MASK_NAMES` or :data:`EXPLICIT`) of ``tok``:
    ``int64`` sorted unique token ids (a fresh array; the named masks are computed once per
    tokenizer fingerprint and vocab size, all three from one decode of the vocabulary).

    ``vocab_size``: the head's rows ``V`` (default ``len(tok)``); ids ``>= V`` are left out.
    ``ids``: the id set of an ``explicit`` mask (special/EOS ids are added to it).

    Raises ``ValueError``: an unknown name, ``ids`` given for a named mask or missing for
    ``explicit``, an explicit id outside the vocabulary, a special id ``>= V``.
    """
    V = _vocab_size(tok, vocab_size)
    specials = special_ids(tok)
    if any(i >= V for i in specials):
        raise ValueError(f"special token id {max(specials)} outside a head of {V} rows")
    if name == EXPLICIT:
        if ids is None:
            raise ValueError("an explicit mask needs its ids")
        return np.union1d(as_mask(ids, V), np.asarray(specials, dtype=np.int64))
    if name not in MASK_NAMES:
        raise ValueError(f"unknown vocabulary mask {name!r:.40}; choose from {', '.join(MASK_NAMES + (EXPLICIT,))}")
    if ids is not None:
        raise ValueError(f"the {name} mask takes no ids (use {EXPLICIT!r})")
    fp = _fingerprint(tok)
    if (fp, name, V) not in _CACHE:
        _CACHE.update({(fp, m, V): a for m, a in _named_masks(tok, V, specials).items()})
    return _CACHE[(fp, name, V)].copy()  # the caller's own (writable) array


def _fingerprint(tok) -> str:
    """:func:`tokenizer_fingerprint`, remembered per tokenizer object and size (it reads the
    whole vocabulary: half a second for 150k tokens)."""
    try:
        size, fp = _FINGERPRINTS[tok]
        if size == len(tok):
            return fp
    except (KeyError, TypeError):
        pass
    fp = tokenizer_fingerprint(tok)
    try:
        _FINGERPRINTS[tok] = (len(tok), fp)
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return fp


def _named_masks(tok, V: int, specials: list[int]) -> dict[str, np.ndarray]:
    """Every named mask at once (one decode of the vocabulary)."""
    n = min(V, len(tok))
    added = set(tok.added_tokens_decoder)
    texts = tok.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    out = {"full": np.arange(V, dtype=np.int64)}
    for name, chars in (("english", ENGLISH_CHARS), ("ascii", ASCII_CHARS)):
        keep = [i for i, t in enumerate(texts) if t and i not in added and chars.issuperset(t)]
        out[name] = np.union1d(np.asarray(keep, dtype=np.int64), np.asarray(specials, dtype=np.int64))
    for a in out.values():
        a.flags.writeable = False
    return out


def bitmap_nbytes(vocab_size: int) -> int:
    """Bytes of a mask bitmap over ``vocab_size`` tokens: ``ceil(V / 8)``."""
    return (vocab_size + 7) // 8


def mask_to_bitmap(ids, vocab_size: int) -> bytes:
    """A mask as a bitmap of :func:`bitmap_nbytes` bytes: bit ``i % 8`` (least significant
    first) of byte ``i // 8`` is set iff id ``i`` is in the mask; padding bits are 0.

    Raises ``ValueError`` as :func:`as_mask`, or ``vocab_size`` outside 1..:data:`MAX_VOCAB`."""
    if not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be an int in 1..{MAX_VOCAB}, got {vocab_size!r}")
    bits = np.zeros(bitmap_nbytes(vocab_size) * 8, dtype=np.uint8)
    bits[as_mask(ids, vocab_size)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def mask_from_bitmap(buf: bytes, vocab_size: int) -> np.ndarray:
    """Inverse of :func:`mask_to_bitmap`: the ``int64`` sorted ids whose bits are set.

    ``vocab_size`` is the receiver's own ``V``, never read from the wire.

    Raises ``ValueError``: a length other than ``ceil(V / 8)``, a padding bit set, or no
    bit set (an empty mask)."""
    if not isinstance(vocab_size, int) or not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be an int in 1..{MAX_VOCAB}, got {vocab_size!r}")
    want = bitmap_nbytes(vocab_size)
    if len(buf) != want:
        raise ValueError(f"a mask bitmap over {vocab_size} tokens is {want} bytes, got {len(buf)}")
    bits = np.unpackbits(np.frombuffer(bytes(buf), dtype=np.uint8), bitorder="little")
    if bits[vocab_size:].any():
        raise ValueError(f"mask bitmap has padding bits set beyond id {vocab_size - 1}")
    ids = np.flatnonzero(bits).astype(np.int64)
    if ids.size == 0:
        raise ValueError("mask bitmap is empty (no token allowed)")
    return ids


# ------------------------------------------------------------------------------ codec

def _check_counts(n: int, size: int, k: int) -> None:
    for name, v, lo in (("n", n, 1), ("size", size, 1), ("k", k, 0)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if k > size:
        raise ValueError(f"top-k of {k} exceeds the mask's {size} tokens")


def masked_nbytes(n: int, size: int, k: int) -> int:
    """Exact bytes of :func:`encode_masked` for ``n`` rows over a mask of ``size`` tokens:
    ``n·(4 + size)`` for ``k = 0``, ``n·(4 + 5k)`` for top-k.

    Raises ``ValueError``: ``n < 1``, ``size < 1``, ``k < 0`` or ``k > size``."""
    _check_counts(n, size, k)
    return int(n) * (4 + (int(size) if k == 0 else 5 * int(k)))


def full_logits_nbytes(n: int, vocab_size: int) -> int:
    """Bytes of full 8-bit logits over the whole vocabulary (``V`` bytes + lo and scale per
    row): the reference a masked downlink is compared to."""
    return masked_nbytes(n, vocab_size, 0)


def downlink_per_token(size: int, k: int, vocab_size: int) -> dict:
    """``{"bytes", "full_bytes", "ratio"}`` per token (one row) of the masked codec vs full
    8-bit logits, codec payload only (the frame adds a constant per message)."""
    b, full = masked_nbytes(1, size, k), full_logits_nbytes(1, vocab_size)
    return {"bytes": b, "full_bytes": full, "ratio": b / full}


def _quantize(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row 8-bit affine quantization of ``v float64 [n, m]``: ``(lo f16, scale f16, q u8)``
    with ``|v - (lo + q·scale)| <= scale/2`` (lo rounded down, scale up to float16)."""
    mn, mx = v.min(axis=1), v.max(axis=1)
    lo = mn.astype(np.float16)
    down = lo.astype(np.float64) > mn
    lo[down] = np.nextafter(lo[down], np.float16(-np.inf))
    lo64 = lo.astype(np.float64)
    want = (mx - lo64) / 255.0
    scale = want.astype(np.float16)
    up = scale.astype(np.float64) < want
    scale[up] = np.nextafter(scale[up], np.float16(np.inf))
    s64 = scale.astype(np.float64)
    safe = np.where(s64 > 0, s64, 1.0)
    q = np.clip(np.rint((v - lo64[:, None]) / safe[:, None]), 0, 255).astype(np.uint8)
    return lo, scale, q


def encode_masked(z, k: int = 0) -> bytes:
    """Encode partial logits ``z [n, |S|]`` (the cloud's, over the mask, in mask order) as
    the whole subset 8-bit (``k = 0``) or its top-k within the subset (see the module
    docstring for the layout).

    Raises ``ValueError``: ``z`` not 2-D or empty, a non-finite value or one beyond ±32752
    (half float16's range, so ``lo`` and ``lo + 255·scale`` stay finite), ``k < 0`` or
    ``k > |S|``."""
    x = z.detach().cpu().double().numpy() if isinstance(z, torch.Tensor) else np.asarray(z, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"partial logits must be [n >= 1, |S| >= 1], got shape {x.shape}")
    n, size = x.shape
    _check_counts(n, size, k)
    if not np.all(np.isfinite(x)):
        raise ValueError("partial logits must be finite")
    if np.abs(x).max() > _F16_MAX / 2:
        raise ValueError(f"partial logits beyond ±{_F16_MAX / 2:g} cannot be sent 8-bit with float16 scales")
    if k == 0:
        lo, scale, q = _quantize(x)
        return lo.astype(_HALF).tobytes() + scale.astype(_HALF).tobytes() + q.tobytes()
    idx = np.argpartition(-x, k - 1, axis=1)[:, :k] if k < size else np.tile(np.arange(size), (n, 1))
    vals = np.take_along_axis(x, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")  # largest first
    idx, vals = np.take_along_axis(idx, order, axis=1), np.take_along_axis(vals, order, axis=1)
    lo, scale, q = _quantize(vals)
    return (lo.astype(_HALF).tobytes() + scale.astype(_HALF).tobytes()
            + idx.astype(_U32).tobytes() + q.tobytes())


@dataclass(frozen=True)
class MaskedLogits:
    """Decoded partial logits over a mask of ``size`` tokens: ``values float32 [n, size]``
    (``k = 0``), or ``values float32 [n, k]`` at ``idx int64 [n, k]`` (positions in the mask,
    largest value first as encoded), plus the per-row ``scale float32 [n]`` (the error bound
    is ``scale / 2``)."""

    values: np.ndarray
    idx: np.ndarray | None
    scale: np.ndarray
    size: int

    @property
    def n(self) -> int:
        return int(self.values.shape[0])

    @property
    def k(self) -> int:
        return 0 if self.idx is None else int(self.idx.shape[1])

    def dense(self, fill: str = "bound") -> np.ndarray:
        """``float32 [n, size]``: the values where sent; in top-k mode elsewhere each row's
        smallest returned value (``fill="bound"``: an upper bound, up to ``scale / 2``, of
        every unsent value, as they all rank below the k-th) or ``-inf`` (``"drop"``).

        Raises ``ValueError`` for another ``fill``."""
        if fill not in FILLS:
            raise ValueError(f"unknown fill {fill!r}; choose from {', '.join(FILLS)}")
        if self.idx is None:
            return self.values
        rest = self.values.min(axis=1, keepdims=True) if fill == "bound" else np.float32(-np.inf)
        out = np.broadcast_to(rest, (self.n, self.size)).astype(np.float32)
        np.put_along_axis(out, self.idx, self.values, axis=1)
        return out


def decode_masked(buf: bytes, n: int, size: int, k: int) -> MaskedLogits:
    """Decode :func:`encode_masked`'s bytes; ``n``, ``size`` and ``k`` are what the device
    asked for (its own bounds), never read from the wire.

    Raises ``ValueError``: bad counts (``k > size``, ...), a length other than
    :func:`masked_nbytes` (checked before reading), a non-finite or negative ``lo``/``scale``,
    an index outside the subset or repeated within a row."""
    want = masked_nbytes(n, size, k)
    if len(buf) != want:
        raise ValueError(f"masked logits for n={n}, |S|={size}, k={k} are {want} bytes, got {len(buf)}")
    n, size, k = int(n), int(size), int(k)
    lo = np.frombuffer(buf, dtype=_HALF, count=n, offset=0).astype(np.float32)
    scale = np.frombuffer(buf, dtype=_HALF, count=n, offset=2 * n).astype(np.float32)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(scale))):
        raise ValueError("masked logits carry a non-finite lo or scale")
    if np.any(scale < 0):
        raise ValueError("masked logits carry a negative scale")
    off = 4 * n
    if k == 0:
        q = np.frombuffer(buf, dtype=np.uint8, count=n * size, offset=off).reshape(n, size)
        return MaskedLogits(lo[:, None] + q.astype(np.float32) * scale[:, None], None, scale, size)
    idx = np.frombuffer(buf, dtype=_U32, count=n * k, offset=off).reshape(n, k).astype(np.int64)
    if idx.max() >= size:
        raise ValueError(f"top-k index {int(idx.max())} outside the mask of {size} tokens")
    if k > 1 and np.any(np.diff(np.sort(idx, axis=1), axis=1) == 0):
        raise ValueError("top-k indices repeat within a row")
    q = np.frombuffer(buf, dtype=np.uint8, count=n * k, offset=off + 4 * n * k).reshape(n, k)
    return MaskedLogits(lo[:, None] + q.astype(np.float32) * scale[:, None], idx, scale, size)


# ------------------------------------------------------------------------------ fusion

def fuse_split_head(z_end: torch.Tensor, z_cloud, mask, k: int | None = None,
                    softcap: float | None = None, fill: str = "bound") -> torch.Tensor:
    """The split head's logits ``float32 [n, V]``: ``z_end + z_cloud`` on the mask, ``-inf``
    outside it (greedy decoding over them never emits an unmasked token).

    Args:
        z_end: the device's partial logits over the whole vocabulary, ``[n, V]``.
        z_cloud: the cloud's over the mask, as :class:`MaskedLogits` (decoded), or a dense
            ``[n, |S|]`` tensor/array (exact values; with ``k >= 1`` its top-k is taken here,
            as the cloud would, without quantization).
        mask: the mask's sorted token ids (``|S|`` of them, all ``< V``).
        k: ``None``: a :class:`MaskedLogits`'s own ``k`` (dense: 0, the whole subset); must
            match a :class:`MaskedLogits`'s ``k``.
        softcap: the head's ``final_logit_softcapping`` (``cap · tanh(z / cap)``), if any.
        fill: top-k mode only, what a mask token outside the cloud's top-k gets.
            ``"bound"``: ``z_end`` + the row's smallest returned value, an upper bound of its
            true fused logit (exact for dense input, up to ``scale/2`` decoded). Then when the
            fused argmax is a returned token it is the exact masked argmax (every other score
            is its true value or above it); a non-returned token can win on the strength of
            its ``z_end`` alone, and may be wrong. ``"drop"``: ``-inf`` (decode among the
            returned tokens only): the fused argmax is the exact masked argmax whenever that
            token is in the top-k. ``bench/bench_split_head.py`` measures both.

    Raises ``ValueError``: shapes that do not match (rows, ``|S|``), a bad mask, a ``k``
    that does not match ``z_cloud``, an unknown ``fill``.
    """
    if fill not in FILLS:
        raise ValueError(f"unknown fill {fill!r}; choose from {', '.join(FILLS)}")
    if z_end.ndim != 2:
        raise ValueError(f"z_end must be [n, V], got shape {tuple(z_end.shape)}")
    n, V = z_end.shape
    ids = as_mask(mask, V)
    if isinstance(z_cloud, MaskedLogits):
        if k is not None and k != z_cloud.k:
            raise ValueError(f"k={k} does not match the cloud's top-{z_cloud.k}")
        if z_cloud.size != ids.size or z_cloud.n != n:
            raise ValueError(f"cloud logits [{z_cloud.n}, |S|={z_cloud.size}] do not match "
                             f"z_end rows {n} and the mask's {ids.size} tokens")
        dense = torch.from_numpy(z_cloud.dense(fill))
    else:
        dense = z_cloud if isinstance(z_cloud, torch.Tensor) else torch.as_tensor(np.asarray(z_cloud))
        dense = dense.float()
        if tuple(dense.shape) != (n, ids.size):
            raise ValueError(f"cloud logits shape {tuple(dense.shape)} != (rows {n}, mask {ids.size})")
        k = 0 if k is None else k
        _check_counts(n, ids.size, k)
        if k:
            top = torch.topk(dense, k, dim=1)
            rest = top.values.min(dim=1, keepdim=True).values if fill == "bound" else float("-inf")
            dense = torch.full_like(dense, 0.0).add_(rest).scatter(1, top.indices, top.values)
    t = torch.tensor(ids)
    fused = z_end.float()[:, t] + dense.to(z_end.device)
    if softcap:
        fused = softcap * torch.tanh(fused / softcap)
    out = torch.full((n, V), float("-inf"), dtype=torch.float32, device=z_end.device)
    out[:, t] = fused
    return out


__all__ = ["MASK_NAMES", "EXPLICIT", "MAX_VOCAB", "special_ids", "as_mask", "vocab_mask",
           "bitmap_nbytes", "mask_to_bitmap", "mask_from_bitmap", "masked_nbytes",
           "full_logits_nbytes", "downlink_per_token", "encode_masked", "decode_masked",
           "MaskedLogits", "fuse_split_head", "FILLS"]
