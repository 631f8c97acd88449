"""Token alignment between two tokenizers, and gathering a sharer's KV onto receiver tokens.

C2C fuses the receiver's KV cache with the sharer's, token by token, so the two caches have
to be put on one time axis. The receiver's tokens are the base: for every receiver token
we list the sharer tokens that cover the same characters, then gather (first / last /
mean) the sharer's keys or values of those tokens into the receiver token's slot.

Assumptions (read before relying on a mapping):

- **Fast tokenizers only.** Alignment uses the character offsets of
  ``tok(text, return_offsets_mapping=True)``; slow tokenizers have none (``ValueError``).
- **Character overlap, whitespace trimmed.** A receiver token maps to every sharer token
  whose character span overlaps its own. Spans are first trimmed of leading and trailing
  whitespace (byte-level BPE glues the preceding space to a word: ``" fox"``), so a word
  does not also match the sharer token that holds the space before it. A token made only
  of whitespace keeps its raw span; when it overlaps no trimmed sharer span it maps to the
  sharer tokens whose *raw* spans hold that whitespace. Tokens with an empty span (BOS/EOS added by the
  tokenizer, not present in the text) map to ``[]``.
- **Partial characters.** Byte-level tokenizers may split one character over several
  tokens; they all carry that character's span, so they all map to the same sharer tokens.
- **Tokenize as you prefill.** A mapping indexes the token sequence ``tok(text,
  add_special_tokens=...)`` produces; it is only valid for a cache prefilled on exactly
  those ids (same text, same ``add_special_tokens``).
- **Formatted prompts** (:func:`align_formatted`): each model wraps the shared user text in
  its own chat template, so the text sits at different character offsets. Only the
  characters of ``content`` are aligned, found by exact substring search in both formatted
  strings (the **last** occurrence, since the user's turn ends a prompt); every token
  wholly outside ``content`` (template markup, role names, system prompts) maps to
  ``[]``. A token that straddles the boundary is aligned by its part inside ``content``.
- **One mapping per batch.** :func:`gather_aligned` applies one mapping to every batch
  row: batch prompts whose tokenizations align identically (or use batch size 1).
"""

from __future__ import annotations

import numpy as np
import torch

REDUCTIONS = ("first", "last", "mean")


def _spans(text: str, tok, add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    """``([T, 2] trimmed spans, [T, 2] raw spans)`` of ``tok(text)`` (see module docstring)."""
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{type(tok).__name__} is not a fast tokenizer: no character offsets to align")
    enc = tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    raw = np.array(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    trimmed = raw.copy()
    for i, (a, b) in enumerate(raw):
        piece = text[a:b]
        if piece.strip():
            trimmed[i] = (a + len(piece) - len(piece.lstrip()), b - len(piece) + len(piece.rstrip()))
    return trimmed, raw


def _hits(r_spans: np.ndarray, s_spans: np.ndarray) -> np.ndarray:
    """``[Tr, Ts]`` bool: non-empty receiver span overlaps non-empty sharer span."""
    ra, rb = r_spans[:, :1], r_spans[:, 1:]
    sa, sb = s_spans[None, :, 0], s_spans[None, :, 1]
    return (ra < sb) & (sa < rb) & (ra < rb) & (sa < sb)


def _overlaps(text: str, r: tuple[np.ndarray, np.ndarray], s: tuple[np.ndarray, np.ndarray]) -> list[list[int]]:
    """For each receiver token, the sharer tokens whose trimmed spans overlap its trimmed span.

    A whitespace-only receiver token (e.g. ``" "`` or ``"\\n\\n"``) that overlaps no trimmed
    sharer span falls back to the sharer's raw spans, so it maps to the sharer token that
    glued that whitespace to a word (``" fox"``).
    """
    (r_trim, r_raw), (s_trim, s_raw) = r, s
    if len(r_trim) == 0:
        return []
    if len(s_trim) == 0:
        return [[] for _ in range(len(r_trim))]
    hit = _hits(r_trim, s_trim)
    blank = np.array([not text[a:b].strip() for a, b in r_raw]) & ~hit.any(axis=1)
    if blank.any():
        hit[blank] = _hits(r_trim[blank], s_raw)
    return [np.flatnonzero(row).tolist() for row in hit]


def align_tokens(text: str, receiver_tok, sharer_tok, add_special_tokens: bool = False) -> list[list[int]]:
    """Map every receiver token of ``text`` to the sharer tokens covering the same characters.

    Both tokenizers see the same ``text``; the result has one list per receiver token
    (``len(receiver_tok(text).input_ids)`` entries), each holding sharer token indices in
    increasing order, ``[]`` where nothing overlaps.

    Raises:
        ValueError: a tokenizer is not a fast tokenizer.
    """
    return _overlaps(text, _spans(text, receiver_tok, add_special_tokens),
                     _spans(text, sharer_tok, add_special_tokens))


def align_spans(
    receiver_text: str,
    receiver_span: tuple[int, int],
    sharer_text: str,
    sharer_span: tuple[int, int],
    receiver_tok,
    sharer_tok,
    add_special_tokens: bool = False,
) -> list[list[int]]:
    """Align two formatted texts through one shared character span each.

    ``receiver_text[receiver_span[0]:receiver_span[1]]`` must equal the sharer's span text.
    Receiver tokens are mapped to sharer tokens of ``sharer_text`` by overlap measured
    inside those spans (both shifted to start at 0); tokens wholly outside the spans map
    to ``[]``; a token straddling a span edge is clipped to the span first.

    Raises:
        ValueError: spans out of range, or the two spans hold different text.
    """
    (ra, rb), (sa, sb) = receiver_span, sharer_span
    if not (0 <= ra <= rb <= len(receiver_text)) or not (0 <= sa <= sb <= len(sharer_text)):
        raise ValueError(f"span out of range: receiver {receiver_span} of {len(receiver_text)} chars, "
                         f"sharer {sharer_span} of {len(sharer_text)} chars")
    if receiver_text[ra:rb] != sharer_text[sa:sb]:
        raise ValueError("the receiver and sharer spans hold different text")

    def clip(spans: np.ndarray, a: int, b: int) -> np.ndarray:
        lo = np.clip(spans[:, 0], a, b) - a
        hi = np.clip(spans[:, 1], a, b) - a
        return np.stack([lo, hi], axis=1)  # outside the span -> empty -> no overlap

    r = tuple(clip(x, ra, rb) for x in _spans(receiver_text, receiver_tok, add_special_tokens))
    s = tuple(clip(x, sa, sb) for x in _spans(sharer_text, sharer_tok, add_special_tokens))
    return _overlaps(receiver_text[ra:rb], r, s)


def align_formatted(
    receiver_text: str,
    sharer_text: str,
    content: str,
    receiver_tok,
    sharer_tok,
    add_special_tokens: bool = False,
) -> list[list[int]]:
    """Align two chat-formatted prompts through the user ``content`` they both contain.

    Every receiver token of ``receiver_text`` gets the indices of the sharer tokens of
    ``sharer_text`` that cover the same characters of ``content``; template tokens outside
    ``content`` get ``[]``. ``content`` is located by exact search (last occurrence).

    Raises:
        ValueError: ``content`` is empty or not found in one of the formatted texts.
    """
    if not content:
        raise ValueError("content is empty: nothing to align")
    ra = receiver_text.rfind(content)
    sa = sharer_text.rfind(content)
    for name, at in (("receiver", ra), ("sharer", sa)):
        if at < 0:
            raise ValueError(f"content not found in the formatted {name} text "
                             "(was it changed by the chat template, e.g. stripped?)")
    return align_spans(receiver_text, (ra, ra + len(content)), sharer_text, (sa, sa + len(content)),
                       receiver_tok, sharer_tok, add_special_tokens)


def gather_aligned(
    sharer_kv: torch.Tensor, mapping: list[list[int]], reduction: str = "mean"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Put a sharer's keys or values on the receiver's token axis.

    Args:
        sharer_kv: ``[B, H, Ts, D]`` keys or values of one sharer layer.
        mapping: one list of sharer token indices per receiver token (``Tr`` lists).
        reduction: how several sharer tokens become one: ``first``, ``last`` or ``mean``.

    Returns:
        ``([B, H, Tr, D], mask [Tr] bool)``: the gathered tensor (zeros where a receiver
        token has no sharer token) and the mask that is ``False`` exactly there.
        Differentiable with respect to ``sharer_kv``.

    Raises:
        ValueError: unknown reduction, or an index outside ``[0, Ts)``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}: use one of {', '.join(REDUCTIONS)}")
    if sharer_kv.dim() != 4:
        raise ValueError(f"sharer_kv must be [B, H, T, D], got shape {tuple(sharer_kv.shape)}")
    ts = sharer_kv.shape[2]
    dst, src, weight = [], [], []
    for r, idx in enumerate(mapping):
        if not idx:
            continue
        if min(idx) < 0 or max(idx) >= ts:
            raise ValueError(f"receiver token {r} maps to sharer indices {idx}, outside [0, {ts})")
        chosen = [idx[0]] if reduction == "first" else [idx[-1]] if reduction == "last" else list(idx)
        dst += [r] * len(chosen)
        src += chosen
        weight += [1.0 / len(chosen)] * len(chosen)
    b, h, _, d = sharer_kv.shape
    device = sharer_kv.device
    mask = torch.tensor([bool(m) for m in mapping], dtype=torch.bool, device=device)
    out = sharer_kv.new_zeros(b, h, len(mapping), d)
    if not src:
        return out, mask
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    picked = sharer_kv.index_select(2, src_t)
    if reduction == "mean":
        w = torch.tensor(weight, dtype=sharer_kv.dtype, device=device)
        picked = picked * w.view(1, 1, -1, 1)
    return out.index_add(2, dst_t, picked), mask
