"""Tensor payloads for the wire: int8 per-row quantization, per-row top-k sparsity, and a
small self-describing binary format (no pickle: payloads come from untrusted peers).

"Rows" are all dimensions but the last, flattened: a ``[2, 8, 64, 64]`` KV tensor has
``2·8·64 = 1024`` rows of 64 values.

Wire format (little-endian)::

    offset  size       field
    0       4          magic b"EFT1"
    4       1          kind   (1 = dense array, 2 = int8 per-row, 3 = sparse top-k)
    5       1          dtype  code of the main buffer (see DTYPE_CODES)
    6       1          ndim   (0..8 for dense, 1..8 otherwise)
    7       4·ndim     shape, uint32 each
    [sparse only] 4    k, uint32
    then the buffers:
      dense:   prod(shape) values of dtype (float32, int32 or int64)
      int8:    prod(shape) int8 values, then rows float16 scales
      sparse:  rows·k uint32 column indices, then rows·k float16 values

:func:`decode` checks the header, computes the exact body size from it with Python integers
and compares it to the bytes present *before* touching the body, so a header claiming a huge
shape fails fast without allocating.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"EFT1"
KIND_DENSE = 1
KIND_INT8 = 2
KIND_SPARSE = 3
KIND_NAMES = {KIND_DENSE: "dense", KIND_INT8: "int8-rows", KIND_SPARSE: "sparse-topk"}
DTYPE_CODES = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(np.int8): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint32): 6,
}
_CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
_DENSE_DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64))
MAX_NDIM = 8
_PREFIX = struct.Struct("<4sBBB")  # magic, kind, dtype, ndim
INT8_MAX = 127
_F16_MAX = float(np.finfo(np.float16).max)  # 65504


class PayloadError(ValueError):
    """A malformed or untrusted payload; the message says what was wrong."""


def _to_numpy(x: Any) -> np.ndarray:
    """A numpy view/copy of a numpy array or torch tensor (bfloat16 goes through float32)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy()
    raise TypeError(f"expected a numpy array or torch tensor, got {type(x).__name__}")


def _rows_2d(x: np.ndarray) -> np.ndarray:
    """``x`` as ``[rows, last_dim]`` float32 (rows = product of all but the last dim)."""
    if x.ndim < 1:
        raise ValueError("need at least 1 dimension (rows are all dims but the last)")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if not np.all(np.isfinite(x)):
        raise ValueError("tensor contains NaN or inf; cannot quantize")
    cols = x.shape[-1]
    return x.reshape(math.prod(x.shape[:-1]), cols)


@dataclass(frozen=True)
class QuantizedTensor:
    """Symmetric per-row int8: ``x[r, c] ≈ data[r, c] · scales[r]``.

    ``data``: int8, the original shape, values in [-127, 127]. ``scales``: float16, shape
    ``[rows]``, ≥ 0 and finite (0 for an all-zero row).
    """

    data: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        if self.data.dtype != np.int8 or self.data.ndim < 1:
            raise ValueError(f"data must be int8 with ndim >= 1, got {self.data.dtype} {self.data.shape}")
        rows = math.prod(self.data.shape[:-1])
        if self.scales.dtype != np.float16 or self.scales.shape != (rows,):
            raise ValueError(
                f"scales must be float16 of shape ({rows},), got {self.scales.dtype} {self.scales.shape}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


@dataclass(frozen=True)
class SparseTensor:
    """Per-row top-k: row ``r`` holds ``values[r, j]`` at column ``indices[r, j]``, zeros elsewhere.

    ``shape``: the dense shape. ``indices``: uint32 ``[rows, k]``, strictly increasing per row,
    each < ``shape[-1]``. ``values``: float16 ``[rows, k]``.
    """

    shape: tuple[int, ...]
    indices: np.ndarray
    values: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if len(self.shape) < 1:
            raise ValueError("sparse tensor needs ndim >= 1")
        rows, cols = math.prod(self.shape[:-1]), self.shape[-1]
        if self.indices.dtype != np.uint32 or self.indices.ndim != 2 or self.indices.shape[0] != rows:
            raise ValueError(
                f"indices must be uint32 [rows={rows}, k], got {self.indices.dtype} {self.indices.shape}"
            )
        if self.values.dtype != np.float16 or self.values.shape != self.indices.shape:
            raise ValueError(
                f"values must be float16 {self.indices.shape}, got {self.values.dtype} {self.values.shape}"
            )
        k = self.indices.shape[1]
        if k > cols:
            raise ValueError(f"k={k} exceeds the last dimension {cols}")
        if self.indices.size and int(self.indices.max()) >= cols:
            raise ValueError(f"column index {int(self.indices.max())} out of range for {cols} columns")
        if k > 1 and not np.all(np.diff(self.indices.astype(np.int64), axis=1) > 0):
            raise ValueError("indices must be strictly increasing within each row")

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])


def quantize_int8_rows(x: Any) -> QuantizedTensor:
    """Symmetric per-row int8 quantization of a float tensor (numpy or torch, ndim ≥ 1).

    ``scale = max|row| / 127`` stored as float16, rounded *up* to the next float16 when needed
    so no value clips; ``q = round(x / scale)``. Hence ``|x - q·scale| ≤ scale / 2`` for every
    element. An all-zero row gets scale 0 and q 0 (no NaN). Rows with ``max|row|`` below
    about ``127 · 6.1e-5 ≈ 7.8e-3`` get a subnormal float16 scale (step ``2^-24``), so their
    scale is coarser in relative terms; the bound above still holds.

    Raises ``ValueError`` for NaN/inf input or a row whose scale would exceed float16's range
    (``max|row| > 127 · 65504``), ``TypeError`` for a non-float tensor.
    """
    arr = _to_numpy(x)
    x2 = _rows_2d(arr).astype(np.float64)
    amax = np.abs(x2).max(axis=1) if x2.shape[1] else np.zeros(x2.shape[0])
    if np.any(amax / INT8_MAX > _F16_MAX):
        raise ValueError(f"row max {amax.max():.4g} too large for a float16 scale")
    scales = (amax / INT8_MAX).astype(np.float16)
    # Rounding to float16 may land just below max|row|/127; step up one ulp so |x/scale| ≤ 127.
    low = scales.astype(np.float64) * INT8_MAX < amax
    scales[low] = np.nextafter(scales[low], np.float16(np.inf))
    s64 = scales.astype(np.float64)
    safe = np.where(s64 > 0, s64, 1.0)[:, None]
    q = np.rint(x2 / safe)
    q = np.clip(q, -INT8_MAX, INT8_MAX).astype(np.int8)
    return QuantizedTensor(data=q.reshape(arr.shape), scales=scales)


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """float32 array of ``q.shape``: ``data · scale`` per row (exact in float32)."""
    rows = q.scales.shape[0]
    out = q.data.reshape(rows, q.shape[-1]).astype(np.float32) * q.scales.astype(np.float32)[:, None]
    return out.reshape(q.shape)


def topk_sparse(x: Any, k: int) -> SparseTensor:
    """Keep the ``k`` largest-magnitude entries of each row (numpy or torch, ndim ≥ 1).

    Ties go to the lower column index. Indices are stored ascending (uint32), values as
    float16. Raises ``ValueError`` if ``k`` is not in ``[0, shape[-1]]``, a kept value overflows
    float16, or the input has NaN/inf.
    """
    arr = _to_numpy(x)
    x2 = _rows_2d(arr)
    cols = x2.shape[1]
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= cols:
        raise ValueError(f"k must be an integer in [0, {cols}], got {k!r}")
    k = int(k)
    order = np.argsort(-np.abs(x2), axis=1, kind="stable")[:, :k]
    idx = np.sort(order, axis=1)
    vals = np.take_along_axis(x2, idx, axis=1)
    if vals.size and np.abs(vals).max() > _F16_MAX:
        raise ValueError(f"value {np.abs(vals).max():.4g} overflows float16")
    return SparseTensor(shape=arr.shape, indices=idx.astype(np.uint32), values=vals.astype(np.float16))


def densify(s: SparseTensor) -> np.ndarray:
    """float32 array of ``s.shape`` with the kept values in place and zeros elsewhere."""
    rows, cols = math.prod(s.shape[:-1]), s.shape[-1]
    out = np.zeros((rows, cols), dtype=np.float32)
    np.put_along_axis(out, s.indices.astype(np.intp), s.values.astype(np.float32), axis=1)
    return out.reshape(s.shape)


def _dense_array(obj: Any) -> np.ndarray:
    arr = np.asarray(_to_numpy(obj))
    if arr.dtype in _DENSE_DTYPES:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        return arr.astype(np.float32)  # float64/float16/bfloat16 travel as float32
    if np.issubdtype(arr.dtype, np.integer) and np.can_cast(arr.dtype, np.int64):
        return arr.astype(np.int64)  # small ints (token ids) widen to int64
    raise TypeError(f"cannot encode an array of dtype {arr.dtype} (float or int token ids only)")


def _header(kind: int, dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    if len(shape) > MAX_NDIM:
        raise ValueError(f"ndim {len(shape)} exceeds {MAX_NDIM}")
    if any(d > 0xFFFFFFFF for d in shape):
        raise ValueError(f"dimension too large for uint32 in shape {shape}")
    return _PREFIX.pack(MAGIC, kind, DTYPE_CODES[np.dtype(dtype)], len(shape)) + struct.pack(
        f"<{len(shape)}I", *shape
    )


def _le(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def encode(obj: Any) -> bytes:
    """Serialize a :class:`QuantizedTensor`, :class:`SparseTensor`, or a dense array/tensor.

    Dense arrays: float32, int32 and int64 keep their dtype; other floats become float32 and
    other integers int64. Raises ``TypeError`` for anything else.
    """
    if isinstance(obj, QuantizedTensor):
        return (
            _header(KIND_INT8, np.int8, obj.shape)
            + _le(obj.data, np.int8)
            + _le(obj.scales, np.float16)
        )
    if isinstance(obj, SparseTensor):
        return (
            _header(KIND_SPARSE, np.float16, obj.shape)
            + struct.pack("<I", obj.k)
            + _le(obj.indices, np.uint32)
            + _le(obj.values, np.float16)
        )
    arr = _dense_array(obj)
    return _header(KIND_DENSE, arr.dtype, arr.shape) + _le(arr, arr.dtype)


def payload_nbytes(obj: Any) -> int:
    """Bytes of ``encode(obj)`` (what the payload costs on the wire before framing)."""
    return len(encode(obj))


def _read(body: memoryview, offset: int, dtype: np.dtype, count: int) -> tuple[np.ndarray, int]:
    dt = np.dtype(dtype).newbyteorder("<")
    arr = np.frombuffer(body, dtype=dt, count=count, offset=offset).astype(np.dtype(dtype))
    return arr, offset + count * dt.itemsize


def decode(data: bytes) -> np.ndarray | QuantizedTensor | SparseTensor:
    """Parse a payload made by :func:`encode`; raises :class:`PayloadError` on any defect.

    Checked: magic, kind, dtype code allowed for the kind, ndim range, header length, exact
    body size (short body or trailing bytes), and content (int8 in [-127, 127], scales finite
    and ≥ 0, sparse k ≤ last dim, indices in range and strictly increasing per row, sparse
    values finite). Dense arrays come back with their dtype and shape, bit-exact.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n < _PREFIX.size:
        raise PayloadError(f"payload is {n} bytes, shorter than the {_PREFIX.size}-byte header")
    magic, kind, code, ndim = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if kind not in KIND_NAMES:
        raise PayloadError(f"unknown payload kind {kind}")
    dtype = _CODE_DTYPES.get(code)
    allowed = {
        KIND_DENSE: _DENSE_DTYPES,
        KIND_INT8: (np.dtype(np.int8),),
        KIND_SPARSE: (np.dtype(np.float16),),
    }[kind]
    if dtype not in allowed:
        raise PayloadError(f"dtype code {code} not allowed for {KIND_NAMES[kind]} payload")
    min_ndim = 0 if kind == KIND_DENSE else 1
    if not min_ndim <= ndim <= MAX_NDIM:
        raise PayloadError(f"ndim {ndim} out of range [{min_ndim}, {MAX_NDIM}]")
    off = _PREFIX.size
    extra = 4 if kind == KIND_SPARSE else 0
    if n < off + 4 * ndim + extra:
        raise PayloadError(f"payload is {n} bytes, too short for a {ndim}-d header")
    shape = struct.unpack_from(f"<{ndim}I", buf, off)
    off += 4 * ndim
    numel = math.prod(shape)  # Python int: no overflow
    rows = math.prod(shape[:-1]) if ndim else 1
    k = 0
    if kind == KIND_SPARSE:
        (k,) = struct.unpack_from("<I", buf, off)
        off += 4
        if k > shape[-1]:
            raise PayloadError(f"sparse k={k} exceeds the last dimension {shape[-1]}")
    if kind == KIND_DENSE:
        body = numel * dtype.itemsize
    elif kind == KIND_INT8:
        body = numel + 2 * rows
    else:
        body = rows * k * (4 + 2)
    # Size check before reading the body: nothing is allocated for a lying header.
    if n - off < body:
        raise PayloadError(
            f"truncated {KIND_NAMES[kind]} payload: shape {list(shape)} needs {body} body bytes, "
            f"got {n - off}"
        )
    if n - off > body:
        raise PayloadError(f"{n - off - body} trailing bytes after a {KIND_NAMES[kind]} payload")

    if kind == KIND_DENSE:
        arr, _ = _read(buf, off, dtype, numel)
        return arr.reshape(shape)
    if kind == KIND_INT8:
        q, off = _read(buf, off, np.int8, numel)
        scales, _ = _read(buf, off, np.float16, rows)
        if q.size and int(q.min()) < -INT8_MAX:
            raise PayloadError("int8 value -128 outside the symmetric range [-127, 127]")
        if not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise PayloadError("int8 scales must be finite and >= 0")
        return QuantizedTensor(data=q.reshape(shape), scales=scales)
    idx, off = _read(buf, off, np.uint32, rows * k)
    vals, _ = _read(buf, off, np.float16, rows * k)
    if not np.all(np.isfinite(vals)):
        raise PayloadError("sparse values must be finite")
    try:
        return SparseTensor(shape=shape, indices=idx.reshape(rows, k), values=vals.reshape(rows, k))
    except ValueError as exc:
        raise PayloadError(f"invalid sparse payload: {exc}") from None
