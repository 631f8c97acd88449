"""Split inference, the model side (no network): cut a decoder LLM into the device's front
(embeddings + the first ``k`` decoder layers) and back (the last ``m`` layers + the final
norm + the LM head, optionally only its first ``head_split`` columns), and the cloud's
middle (layers ``k .. L-m-1``), which sees only activations, never token ids.

The parts are decoder bodies of the model's own class (e.g. ``Qwen2Model``), built on the
meta device and given the original's parameter objects (shared storage, nothing copied);
each has its own config (``num_hidden_layers``, ``layer_types`` sliced), so its layers'
``layer_idx`` count from 0 and a plain ``DynamicCache`` per part works. Positions are
absolute everywhere: the p-th token of a session sits at position p in the front, the
middle and the back (a middle cache rebuilt from a re-sent window starts at the window's
first absolute position, ``offsets`` in :func:`middle_forward`).

Supported architectures (:data:`SUPPORTED`): ``qwen2`` (Qwen2 / Qwen2.5 incl. -Coder),
``llama`` (Llama, SmolLM2) and ``gemma3_text`` (Gemma 3 text: sliding/full layer mix, the
scaled embedding stays in the front, the final soft-cap is applied on the device).

Activations on the wire (:func:`encode_acts`), little-endian, row-major, ``n`` rows of ``D``:

- ``int8``: ``n`` float16 scales, then ``n·D`` int8 values (``acts_nbytes = n·(D + 2)``);
  per-row symmetric absmax (:func:`edgefuse.transport.quant.quantize_int8_rows`): row r
  decodes to ``q · scale_r`` and every element obeys ``|x - x̂| <= scale_r / 2`` with
  ``scale_r ≈ max|x_r| / 127`` (rounded up to a float16, so nothing clips).
- ``float16``: ``n·D`` float16 values (``acts_nbytes = 2·n·D``), round to nearest:
  ``|x - x̂| <= 2^-11·|x|`` in float16's normal range (``|x| >= 2^-14``), ``<= 2^-25``
  below it; ``|x| > 65504`` is refused.

Memory: :func:`free_unused` gives each side only what it holds (the device: front, back,
head; the cloud: the middle + the head's tail columns); drop the original model after it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from edgefuse.cloud.target import batched_forward
from edgefuse.kvcache import cache_from_layers
from edgefuse.transport.quant import INT8_MAX, quantize_int8_rows

SUPPORTED = ("qwen2", "llama", "gemma3_text")  # config.model_type values split_model cuts
ACTS = ("int8", "float16")  # activation encodings
_F16_MAX = float(np.finfo(np.float16).max)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class SplitSpec:
    """Where a model is cut and how activations travel.

    Fields: ``k`` decoder layers on the device before the cloud (>= 1); ``m`` layers on the
    device after it (>= 0; 0 = only the final norm); ``head_split`` None (the device holds
    the whole LM head) or ``s`` in 1..D-1 (the device computes logits from hidden columns
    ``[:s]``, the cloud the partial logits of ``[s:]``); ``act``: ``"int8"`` or ``"float16"``.

    Raises ``ValueError`` naming the field for a wrong type or value (the model-dependent
    bounds are :meth:`check`'s)."""

    k: int
    m: int
    head_split: int | None = None
    act: str = "int8"

    def __post_init__(self):
        for name in ("k", "m"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"SplitSpec.{name} must be an int, got {getattr(self, name)!r:.40}")
        if self.k < 1:
            raise ValueError(f"SplitSpec.k must be >= 1 (the device keeps the first layer), got {self.k}")
        if self.m < 0:
            raise ValueError(f"SplitSpec.m must be >= 0, got {self.m}")
        if self.head_split is not None and (not _is_int(self.head_split) or self.head_split < 1):
            raise ValueError(f"SplitSpec.head_split must be None or an int >= 1, got {self.head_split!r:.40}")
        if not isinstance(self.act, str) or self.act not in ACTS:
            raise ValueError(f"SplitSpec.act must be one of {ACTS}, got {self.act!r:.40}")
        object.__setattr__(self, "k", int(self.k))
        object.__setattr__(self, "m", int(self.m))
        if self.head_split is not None:
            object.__setattr__(self, "head_split", int(self.head_split))

    def check(self, n_layers: int, hidden_size: int) -> "SplitSpec":
        """Check against a model of ``n_layers`` decoder layers and hidden size ``D``: at
        least one middle layer (``k + m <= L - 1``) and ``head_split`` in 1..D-1. Returns
        self; raises ``ValueError`` naming the field."""
        if self.k + self.m > n_layers - 1:
            raise ValueError(f"SplitSpec.k + SplitSpec.m must be <= {n_layers - 1} (the model has "
                             f"{n_layers} layers; the cloud needs at least one), got "
                             f"k={self.k}, m={self.m}")
        if self.head_split is not None and not 1 <= self.head_split <= hidden_size - 1:
            raise ValueError(f"SplitSpec.head_split must be None or in 1..{hidden_size - 1} "
                             f"(hidden size {hidden_size}), got {self.head_split}")
        return self

    def to_dict(self) -> dict:
        """``{"k", "m", "head_split", "act"}`` (JSON-ready)."""
        return {"k": self.k, "m": self.m, "head_split": self.head_split, "act": self.act}

    @classmethod
    def from_dict(cls, d: Any) -> "SplitSpec":
        """A spec from untrusted JSON: a dict with ``k`` and ``m`` (ints), optional
        ``head_split`` (int or None) and ``act`` (str); other keys are refused. Raises
        ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"split spec must be a JSON object, got {type(d).__name__}")
        extra = sorted(str(key)[:20] for key in d if key not in ("k", "m", "head_split", "act"))
        if extra:
            raise ValueError(f"split spec has unknown fields {extra[:4]}")
        for key in ("k", "m"):
            if key not in d:
                raise ValueError(f"split spec lacks SplitSpec.{key}")
        return cls(d["k"], d["m"], d.get("head_split"), d.get("act", "int8"))


@dataclass
class SplitParts:
    """A model cut in three (see :func:`split_model`).

    ``front``: body with ``embed_tokens`` + layers ``[0, k)``, norm = Identity; ``middle``:
    layers ``[k, L-m)``, no embedding (called with ``inputs_embeds``), norm = Identity;
    ``back``: layers ``[L-m, L)`` + the final norm; ``head``: the LM head weight ``[V, D]``;
    ``tail``: the cloud's head columns ``[V, D - s]`` (only after :func:`free_unused` with a
    split head); ``softcap``: the final logit soft-cap (None for none). A part a side does
    not hold is None."""

    front: nn.Module | None
    middle: nn.Module | None
    back: nn.Module | None
    head: torch.Tensor | None
    k: int
    m: int
    n_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str
    softcap: float | None = None
    tail: torch.Tensor | None = None


def _part(body: nn.Module, lo: int, hi: int, *, embed: bool, norm: bool, model_type: str) -> nn.Module:
    """A body of ``type(body)`` holding ``body.layers[lo:hi]`` (the same parameter objects),
    its layers numbered from 0; the embedding (shared) when ``embed``, else None; the final
    norm when ``norm``, else Identity."""
    cfg = copy.deepcopy(body.config)
    cfg.num_hidden_layers = hi - lo
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(body.config.layer_types[lo:hi])
    with torch.device("meta"):
        part = type(body)(cfg)
    state = {}
    for i, layer in enumerate(body.layers[lo:hi]):
        state.update({f"layers.{i}.{n}": t for n, t in layer.state_dict(keep_vars=True).items()})
    if norm:
        state.update({f"norm.{n}": t for n, t in body.norm.state_dict(keep_vars=True).items()})
    res = part.load_state_dict(state, strict=False, assign=True)
    if res.unexpected_keys:
        raise ValueError(f"cannot split {model_type}: unexpected weights {res.unexpected_keys[:3]}")
    part.rotary_emb = body.rotary_emb  # non-persistent buffers (inv_freq): share the module
    part.embed_tokens = body.embed_tokens if embed else None
    if not norm:
        part.norm = nn.Identity()
    left = [n for n, t in [*part.named_parameters(), *part.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"cannot split {model_type}: {left[0]} got no weights from the model")
    return part.eval()


def split_model(model, k: int, m: int, *, middle: bool = True) -> SplitParts:
    """Cut a causal LM into front / middle / back bodies sharing its parameters.

    Args:
        model: a causal LM of :data:`SUPPORTED` (``model.config.model_type``), eval mode.
        k: decoder layers of the front (>= 1); m: layers of the back (>= 0), ``k + m <= L-1``.
        middle: False = no middle part (a device whose model was loaded without the middle
            layers, :func:`edgefuse.models.load_model` ``layers=``).
    Returns:
        :class:`SplitParts` (parameters shared with ``model``: no copy).
    Raises:
        ValueError: an unsupported architecture (named), a head with a bias, bad ``k``/``m``.
    """
    cfg = model.config
    model_type = str(getattr(cfg, "model_type", type(model).__name__))
    if model_type not in SUPPORTED:
        raise ValueError(f"split_model cannot split a {model_type!r} model (supported: "
                         f"{', '.join(SUPPORTED)})")
    get_decoder = getattr(model, "get_decoder", None)
    body = get_decoder() if get_decoder is not None else None
    head_mod = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    needs = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or head_mod is None or not all(hasattr(body, a) for a in needs):
        raise ValueError(f"split_model needs a causal LM with a decoder body and an LM head, got "
                         f"{type(model).__name__}")
    if getattr(head_mod, "bias", None) is not None:
        raise ValueError(f"cannot split {model_type}: its LM head has a bias")
    L, D = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    SplitSpec(k, m).check(L, D)
    kw = dict(model_type=model_type)
    return SplitParts(
        front=_part(body, 0, k, embed=True, norm=False, **kw),
        middle=_part(body, k, L - m, embed=False, norm=False, **kw) if middle else None,
        back=_part(body, L - m, L, embed=False, norm=True, **kw),
        head=head_mod.weight, k=int(k), m=int(m), n_layers=L, hidden_size=D,
        vocab_size=int(head_mod.weight.shape[0]), model_type=model_type,
        softcap=getattr(cfg, "final_logit_softcapping", None) or None)


def free_unused(parts: SplitParts, side: str, head_split: int | None = None) -> SplitParts:
    """The parts one side keeps: ``"device"`` = front, back, head (no middle); ``"cloud"``
    = the middle, plus the head's tail columns ``[V, D - s]`` (a copy) when ``head_split``
    is ``s``. The rest is released once the caller also drops the original model (the parts
    share its parameters). Raises ``ValueError`` for another side or a bad ``head_split``."""
    if side == "device":
        return SplitParts(parts.front, None, parts.back, parts.head, parts.k, parts.m,
                          parts.n_layers, parts.hidden_size, parts.vocab_size, parts.model_type,
                          parts.softcap)
    if side == "cloud":
        tail = None if head_split is None else head_tail(parts.head, head_split).clone()
        return SplitParts(None, parts.middle, None, None, parts.k, parts.m, parts.n_layers,
                          parts.hidden_size, parts.vocab_size, parts.model_type, parts.softcap, tail)
    raise ValueError(f"side must be 'device' or 'cloud', got {side!r:.20}")


KV = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per layer, [1, heads, T, d] each


def crop_layers(layers: KV, n: int) -> KV:
    """The first ``n`` positions of every ``(k, v)`` layer ``[1, heads, T, d]`` (views): the
    rollback of rejected draft rows (causal: earlier rows never saw them). Not the eviction
    of a sliding window, which drops the whole cache. Raises ``ValueError`` if ``n`` is
    outside ``0..T``."""
    have = layers[0][0].shape[2] if layers else 0
    if not _is_int(n) or not 0 <= n <= have:
        raise ValueError(f"cannot crop a cache of {have} positions to {n!r:.20}")
    return [(k[:, :, :n], v[:, :, :n]) for k, v in layers]


@torch.no_grad()
def middle_forward(middle: nn.Module, per: list, pasts: list[int], inputs: list[torch.Tensor],
                   offsets: list[int] | None = None, padding=None):
    """The middle layers over several sessions in one forward pass.

    Row b continues its cache ``per[b]`` (``[(k, v)]`` per middle layer of ``pasts[b]``
    positions, None when 0) with ``inputs[b]`` (``[n_b, D]`` float activations of the front,
    n_b >= 1). ``offsets[b]``: the absolute position of that cache's first row (0 unless it
    was rebuilt from a re-sent window: ``base_len - window``), so row b's new rows sit at
    ``offsets[b] + pasts[b] + 0..n_b-1``. Sessions share no tensors (see
    :func:`edgefuse.cloud.target.batched_forward`, which pads the rows by ``padding``).

    Returns ``(outs, kvs)``: per row ``[n_b, D]`` outputs (no final norm) and its new cache
    of exactly ``pasts[b] + n_b`` positions. Raises ``ValueError`` for mismatched lengths or
    shapes."""
    D = int(middle.config.hidden_size)
    if not inputs or not len(per) == len(pasts) == len(inputs):
        raise ValueError(f"middle_forward: {len(per)} caches, {len(pasts)} lengths, {len(inputs)} inputs")
    for b, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != D or x.shape[0] < 1:
            raise ValueError(f"middle_forward: input {b} must be a float tensor [n >= 1, {D}], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if not x.is_floating_point():
            raise ValueError(f"middle_forward: input {b} is not floating point")
    n_mid = len(middle.layers)
    for b, (kv, p) in enumerate(zip(per, pasts)):
        have = (0, 0) if kv is None else (kv[0][0].shape[2] if kv else 0, len(kv))
        if (p and have != (p, n_mid)) or (not p and kv is not None and have[0]):
            raise ValueError(f"middle_forward: cache {b} holds {have[0]} positions of {have[1]} "
                             f"layers; expected {p} of {n_mid}")
    outs, kvs = batched_forward(middle, per, pasts, inputs, 0, padding, "last_hidden_state", offsets)
    kvs = [crop_layers(kv, int(p) + len(x)) for kv, p, x in zip(kvs, pasts, inputs)]
    return outs, kvs


def softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(z / cap)`` (Gemma's final logit soft-cap), ``z`` when ``cap`` is None;
    ``-inf`` stays ``-inf`` (a masked-out token stays out)."""
    if not cap:
        return z
    return torch.where(torch.isneginf(z), z, torch.tanh(z / cap) * cap)


def head_tail(head: torch.Tensor, s: int) -> torch.Tensor:
    """The cloud's share of the LM head: columns ``[s:]`` of ``head [V, D]`` → ``[V, D - s]``
    (a view). Raises ``ValueError`` unless ``1 <= s <= D - 1``."""
    D = head.shape[1]
    if not _is_int(s) or not 1 <= s <= D - 1:
        raise ValueError(f"head_split must be in 1..{D - 1}, got {s!r:.20}")
    return head[:, int(s):]


@torch.no_grad()
def partial_logits(tail_w: torch.Tensor, h_tail: torch.Tensor, ids=None) -> torch.Tensor:
    """The cloud's partial logits ``h_tail · tail_w[ids]ᵀ`` → float32 ``[n, |ids|]`` (``ids``
    None = all V; else a 1-D sequence of ids in 0..V-1, in the order given). Adding the
    device's ``z_end`` (:meth:`DeviceSplit.head_part`) gives the full pre-soft-cap logits.
    Raises ``ValueError`` for a shape mismatch or an id outside the vocabulary."""
    V, W = tail_w.shape
    if h_tail.ndim != 2 or h_tail.shape[1] != W:
        raise ValueError(f"partial_logits: h_tail must be [n, {W}], got {tuple(h_tail.shape)}")
    w = tail_w
    if ids is not None:
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= V):
            raise ValueError(f"partial_logits: ids must be in 0..{V - 1}")
        w = tail_w[idx]
    return F.linear(h_tail.to(w.dtype), w).float()


# -- activation codec ---------------------------------------------------------------------

def _check_act(act: str) -> None:
    if act not in ACTS:
        raise ValueError(f"activation encoding must be one of {ACTS}, got {act!r:.20}")


def acts_nbytes(n: int, D: int, act: str) -> int:
    """Exact bytes of ``n`` rows of ``D`` activations: ``n·(D + 2)`` (int8) or ``2·n·D``
    (float16). Raises ``ValueError`` for a negative count or unknown ``act``."""
    _check_act(act)
    if not (_is_int(n) and _is_int(D)) or n < 0 or D < 1:
        raise ValueError(f"bad activation shape n={n!r:.20}, D={D!r:.20}")
    return int(n) * (int(D) + 2) if act == "int8" else 2 * int(n) * int(D)


def encode_acts(x, act: str) -> bytes:
    """Encode ``x [n, D]`` (torch or numpy, float) as ``act`` (layouts in the module
    docstring). Raises ``ValueError`` for a wrong shape, NaN/inf, or a value float16 cannot
    hold (|x| > 65504 for float16, max|row| > 127·65504 for int8)."""
    _check_act(act)
    arr = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"activations must be a float [n, D] array, got {arr.dtype} {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("activations contain NaN or inf")
    if act == "int8":
        q = quantize_int8_rows(arr)
        return q.scales.astype("<f2").tobytes() + q.data.tobytes()
    if arr.size and float(np.abs(arr).max()) > _F16_MAX:
        raise ValueError(f"activation {float(np.abs(arr).max()):.4g} overflows float16")
    return np.ascontiguousarray(arr, dtype="<f2").tobytes()


def decode_acts(buf, n: int, D: int, act: str) -> torch.Tensor:
    """Decode ``n`` rows of ``D`` activations from ``buf`` (bytes-like of exactly
    :func:`acts_nbytes` bytes) → float32 ``[n, D]``. ``n`` and ``D`` come from the caller
    (the cloud's own model and its bounds), never from ``buf``. Raises ``ValueError`` for a
    wrong length, a NaN / inf / negative scale, an int8 value of -128, or a non-finite
    float16 value."""
    need = acts_nbytes(n, D, act)
    data = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    if len(data) != need:
        raise ValueError(f"activations: {len(data)} bytes for {n} rows of {D} {act}; expected {need}")
    if act == "int8":
        scales = np.frombuffer(data, dtype="<f2", count=n).astype(np.float32)
        if not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise ValueError("activations: a scale is NaN, inf or negative")
        q = np.frombuffer(data, dtype=np.int8, offset=2 * n).reshape(n, D)
        if q.size and int(q.min()) < -INT8_MAX:
            raise ValueError(f"activations: int8 value below -{INT8_MAX}")
        return torch.from_numpy(q.astype(np.float32) * scales[:, None])
    vals = np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(n, D)
    if not np.all(np.isfinite(vals)):
        raise ValueError("activations: a float16 value is NaN or inf")
    return torch.from_numpy(vals)


# -- the device's side of one session -------------------------------------------------------

class DeviceSplit:
    """The device's state for one split session: the front's and the back's KV caches and
    the committed front rows (to re-send a window the cloud no longer holds).

    ``front(ids)`` extends the front at absolute positions ``length ..``; the middle's
    output for those rows goes through ``back(h)`` (in order; the back never runs ahead of
    the front), then ``logits`` (whole head) or ``head_part`` (split head). ``crop(n)``
    rolls every cache and the remembered rows back to ``n`` positions.

    Raises ``ValueError`` if ``spec`` does not fit ``parts`` or the device parts were freed."""

    def __init__(self, parts: SplitParts, spec: SplitSpec):
        spec.check(parts.n_layers, parts.hidden_size)
        if (spec.k, spec.m) != (parts.k, parts.m):
            raise ValueError(f"SplitSpec k={spec.k}, m={spec.m} but the parts were cut at "
                             f"k={parts.k}, m={parts.m}")
        if parts.front is None or parts.back is None or parts.head is None:
            raise ValueError("the device's parts (front, back, head) were freed")
        self.parts, self.spec = parts, spec
        self._front_cache, self._back_cache = DynamicCache(), DynamicCache()
        self._rows = torch.zeros((0, parts.hidden_size), dtype=parts.head.dtype, device=parts.head.device)
        self._back_len = 0

    @property
    def length(self) -> int:
        """Positions the front holds (committed + pending rows)."""
        return int(self._rows.shape[0])

    @property
    def back_length(self) -> int:
        """Positions the back holds (<= :attr:`length`)."""
        return self._back_len

    @torch.no_grad()
    def front(self, ids) -> torch.Tensor:
        """Embed and run the first ``k`` layers over ``ids`` (n >= 1 token ids) at positions
        ``length .. length + n - 1``; remembers the rows. Returns ``[n, D]`` (the model's
        dtype). Raises ``ValueError`` for no ids or an id outside the vocabulary."""
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1), device=self._rows.device)
        if ids.numel() == 0:
            raise ValueError("front: no token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.parts.vocab_size:
            raise ValueError(f"front: token ids must be in 0..{self.parts.vocab_size - 1}")
        pos = torch.arange(self.length, self.length + ids.numel(), device=ids.device).unsqueeze(0)
        out = self.parts.front(input_ids=ids.unsqueeze(0), position_ids=pos,
                               cache=self._front_cache, use_cache=True).last_hidden_state[0]
        self._rows = torch.cat([self._rows, out.to(self._rows.dtype)])
        return out

    def front_rows(self, start: int, end: int) -> torch.Tensor:
        """The remembered front rows of positions ``start .. end - 1`` → ``[end - start, D]``.
        Raises ``ValueError`` unless ``0 <= start <= end <= length``."""
        if not (_is_int(start) and _is_int(end)) or not 0 <= start <= end <= self.length:
            raise ValueError(f"front_rows({start!r:.20}, {end!r:.20}) outside 0..{self.length}")
        return self._rows[start:end]

    @torch.no_grad()
    def back(self, h: torch.Tensor) -> torch.Tensor:
        """Run the last ``m`` layers and the final norm over ``h [n, D]`` (the middle's output
        for positions ``back_length .. back_length + n - 1``). Returns the final hidden
        ``[n, D]``. Raises ``ValueError`` for a wrong shape or rows the front has not run."""
        D = self.parts.hidden_size
        if h.ndim != 2 or h.shape[1] != D or h.shape[0] < 1:
            raise ValueError(f"back: h must be [n >= 1, {D}], got {tuple(h.shape)}")
        n = int(h.shape[0])
        if self._back_len + n > self.length:
            raise ValueError(f"back: {n} rows after {self._back_len} exceed the {self.length} "
                             f"rows the front ran")
        pos = torch.arange(self._back_len, self._back_len + n, device=self._rows.device).unsqueeze(0)
        h = h.to(device=self._rows.device, dtype=self._rows.dtype)
        out = self.parts.back(inputs_embeds=h.unsqueeze(0), position_ids=pos,
                              cache=self._back_cache, use_cache=True).last_hidden_state[0]
        self._back_len += n
        return out

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``float32 [n, V]`` of final hidden rows ``h [n, D]``,
        soft-capped as the model does (Gemma), like ``EdgeLM.logits``."""
        head = self.parts.head
        return softcap(F.linear(h.to(head.device, head.dtype), head).float(), self.parts.softcap)

    @torch.no_grad()
    def head_part(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's half of a split head: ``(z_end, tail)`` with ``z_end = h[:, :s] ·
        head[:, :s]ᵀ`` (float32 ``[n, V]``) and ``tail = h[:, s:]`` (``[n, D - s]``, for
        HEAD). ``z_end + partial_logits(tail_w, tail)`` = the pre-soft-cap logits; apply
        :func:`softcap` (``parts.softcap``) after fusing. Raises ``ValueError`` without a
        split head."""
        s = self.spec.head_split
        if s is None:
            raise ValueError("head_part: this session's SplitSpec has no head_split")
        head = self.parts.head
        h = h.to(head.device, head.dtype)
        return F.linear(h[:, :s], head[:, :s]).float(), h[:, s:]

    def crop(self, n: int) -> None:
        """Roll back to ``n`` positions: the front's and the back's caches and the remembered
        rows (drafted rows past ``n`` forgotten). Raises ``ValueError`` unless
        ``0 <= n <= length``."""
        if not _is_int(n) or not 0 <= n <= self.length:
            raise ValueError(f"crop({n!r:.20}) outside 0..{self.length}")
        n = int(n)
        self._front_cache = _crop_cache(self._front_cache, n)
        self._back_len = min(self._back_len, n)
        self._back_cache = _crop_cache(self._back_cache, self._back_len)
        self._rows = self._rows[:n]


def _crop_cache(cache: DynamicCache, n: int) -> DynamicCache:
    """A cache of the first ``n`` positions of ``cache`` (views; a fresh one when empty)."""
    layers = [(x.keys, x.values) for x in cache.layers if getattr(x, "keys", None) is not None]
    if not layers or n == 0:
        return DynamicCache()
    return cache_from_layers(crop_layers(layers, min(n, layers[0][0].shape[2])))
