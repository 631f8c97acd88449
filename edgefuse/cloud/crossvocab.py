"""Decoding across two vocabularies: the device drafts and fuses in its own tokens, the
cloud verifies and scores in its own, and both meet on the bytes of the text.

Where the device's tokenizer differs from the cloud's (SmolLM2 or Gemma 3 against Qwen2.5),
ids cannot cross as they are. The idea follows Hugging Face's Universal Assisted Generation
(UAG: the assistant's tokens decoded to text and re-encoded with the target's tokenizer),
with two changes:

* **Where the re-tokenization runs.** The cloud's tokenizer is public (its vocabulary is what
  the OPEN's fingerprint names), so the device holds a copy (:class:`CrossVocab`) and does the
  re-tokenization itself: the link carries the cloud's ids as for any device, the service
  never parses text from a client, and sessions of every tokenizer are the same kind of
  session to its batcher (they batch together with no special case).
* **Alignment is byte-exact, not a look-behind window.** Both sides work on bytes, never on
  decoded strings (:func:`token_bytes`). The device's model is fed some tokenization of
  exactly the committed bytes (:class:`ByteFollower`): the longest run of its own tokens that
  spells a prefix of them stays (its KV cache too), the rest is re-encoded. UAG's window
  guesses where the two tokenizations re-align; here nothing is guessed.

**Lossless.** Whatever ids the device proposes, greedy verification keeps a proposed id only
while it equals the target's argmax, so the committed ids are the target's own greedy ids (on
its own tokenization of its own prompt) whatever the draft, its tokenizer or where its token
boundaries fall. At temperature > 0 each proposed cloud id is sent with the point mass
``q = δ_t`` (accepted with probability ``p(t)``, else resampled from ``p`` without ``t``):
exact for any proposal made without the cloud's randomness (Leviathan et al. 2023 with a
deterministic draft). The price: the device's own ``q`` does not carry over to another
vocabulary, so acceptance is ``p(t)`` rather than ``min(1, p/q)``.

**Token boundaries.** A draft's text re-encoded by the cloud's tokenizer ends with a piece
that may still grow (the device drafted ``" wor"``, the cloud would write ``" world"``), so
the last cloud id of a re-encoded draft is held back until more text follows it
(:class:`~edgefuse.cloud.decoding.cross.CrossDrafter`). Text that ends inside a UTF-8
character (a byte-level token can hold half of one) is held back too (:func:`utf8_boundary`):
no draft starts until the bytes that complete it are committed.

**Cross-vocabulary fusion** (:func:`candidates`, :func:`fuse_candidates`): per step the
candidates are the cloud's top-k tokens and the device's top-k tokens, each a byte string. A
candidate's score under a model is that model's log-probability of emitting exactly those
bytes as its next token, or, where its vocabulary has no such token, the log-probability of
the first token of its own tokenization of them (device) or the cloud's tail mass spread
evenly (cloud, as :func:`edgefuse.cloud.fusion.cloud_logprobs`). With weight ``w`` the fused
score is ``w·edge + (1 − w)·cloud``; ties go to a device token when ``w ≥ 0.5``, else to a
cloud entry, so ``w = 1`` emits the edge's own greedy token and ``w = 0`` the cloud's.
"""

from __future__ import annotations

import functools
import json
import math
import re
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from edgefuse.cloud.protocol import ProtocolError, TopK

_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>")
# round-trip probes every byte table must pass (spaces, digits, code, accents, CJK, emoji)
_PROBES = ("Hello, world! 12 + 30 = 42.", "  def f(x):\n\treturn x**2  # square",
           "naïve café — déjà vu", "数学 题目", "emoji 🙂 ok", " leading space", "tabs\t\tand\nnewlines")


class VocabError(ValueError):
    """A tokenizer whose tokens cannot be mapped to bytes (a decoder edgefuse does not know)."""


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte
    (Radford et al. 2019, ``bytes_to_unicode``): bytes that are printable Latin-1 stand for
    themselves, the other 68 are shifted to 256 + n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def _decoder_types(tok) -> set[str]:
    """The type names of the tokenizer's decoder (a ``Sequence`` flattened)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise VocabError(f"{type(tok).__name__} has no fast (tokenizers) backend")
    spec = json.loads(backend.to_str()).get("decoder") or {}
    out, todo = set(), [spec]
    while todo:
        d = todo.pop()
        out.add(d.get("type"))
        todo.extend(d.get("decoders") or [])
    return out


def end_ids(tok) -> set[int]:
    """The ids that end a generation: the tokenizer's EOS and the chat end-of-turn tokens
    (``<|im_end|>``, ``<|endoftext|>``, ``<end_of_turn>``) its vocabulary holds."""
    eos = tok.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    vocab = tok.get_vocab()
    ids.update(int(vocab[t]) for t in _END_TOKENS if t in vocab)
    return {int(i) for i in ids}


@dataclass(frozen=True)
class ByteVocab:
    """A tokenizer's tokens as bytes.

    ``table[i]``: the bytes of token ``i`` (``b""`` for special tokens); ``ends``: the ids that
    end a generation (:func:`end_ids`); ``by_bytes``: bytes -> the ids spelling exactly them
    (non-empty ones); ``size``: the number of ids."""
    table: tuple[bytes, ...]
    ends: frozenset[int]
    by_bytes: dict[bytes, tuple[int, ...]] = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.table)

    @functools.cached_property
    def blank(self) -> list[int]:
        """The ids that spell nothing and end nothing (special tokens such as ``<pad>``)."""
        return [i for i, b in enumerate(self.table) if not b and i not in self.ends]

    def join(self, ids) -> bytes:
        """The bytes of ``ids`` in order. Raises ``ValueError`` for an id outside the table."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.table):
                raise ValueError(f"token id {i} outside the vocabulary of {len(self.table)}")
            out.append(self.table[i])
        return b"".join(out)


def token_bytes(tok) -> ByteVocab:
    """The :class:`ByteVocab` of ``tok``, built once per tokenizer object (about a second for
    262k tokens).

    Byte-level BPE (a ``ByteLevel`` decoder): each character of the token string is one byte
    of GPT-2's alphabet. SentencePiece with byte fallback (``Replace ▁→space``,
    ``ByteFallback``): ``<0xNN>`` is byte NN, else ``▁`` is a space and the rest is UTF-8.
    Added tokens that are not special are their content's UTF-8.

    Raises :class:`VocabError`: another decoder, or a table that fails to spell the round-trip
    probes (``tok``'s ids of a text must join to exactly its bytes)."""
    try:
        size, vocab = _TABLES[tok]
        if size == len(tok):
            return vocab
    except (KeyError, TypeError):
        pass
    types = _decoder_types(tok)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    special = {int(i) for i in tok.all_special_ids}
    added = {int(i): t.content for i, t in (tok.added_tokens_decoder or {}).items()}
    if "ByteLevel" in types:
        inv = _byte_level_decoder()

        def spell(p: str) -> bytes:
            return bytes(inv[c] for c in p)
    elif "ByteFallback" in types:
        def spell(p: str) -> bytes:
            m = _FALLBACK_BYTE.fullmatch(p)
            return bytes([int(m.group(1), 16)]) if m else p.replace("\u2581", " ").encode()
    else:
        raise VocabError(f"cannot map {type(tok).__name__}'s tokens to bytes: its decoder is "
                         f"{sorted(t for t in types if t)} (byte-level BPE or byte fallback needed)")
    table = []
    for i, p in enumerate(pieces):
        if i in special or p is None:
            table.append(b"")
        elif i in added:
            table.append(added[i].encode())
        else:
            try:
                table.append(spell(p))
            except KeyError:
                raise VocabError(f"token {i} ({p!r:.40}) is not in the byte-level alphabet") from None
    by: dict[bytes, list[int]] = {}
    for i, b in enumerate(table):
        if b:
            by.setdefault(b, []).append(i)
    vocab = ByteVocab(tuple(table), frozenset(end_ids(tok)), {k: tuple(v) for k, v in by.items()})
    for text in _PROBES:
        ids = encode(tok, text)
        if vocab.join(ids) != text.encode():
            raise VocabError(f"{type(tok).__name__}'s tokens do not spell {text!r} back "
                             "(a normalizer or a dummy prefix changes the text)")
    try:
        _TABLES[tok] = (len(tok), vocab)
    except TypeError:  # not weak-referenceable: rebuilt next time
        pass
    return vocab


def encode(tok, text: str) -> list[int]:
    """``text`` as ``tok``'s ids, no special tokens added and none parsed: a ``<|im_end|>``
    in the text is text, never the control token."""
    return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def utf8_boundary(data: bytes) -> int:
    """The length of the longest prefix of ``data`` that does not end inside a UTF-8
    character (``len(data)`` when it ends on a boundary; invalid bytes count as whole)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit?
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 \
                else 4 if b >> 3 == 0b11110 else 1
            return n if back >= need else n - back
    return n




# ------------------------------------------------------------------ the pair of vocabularies

class CrossVocab:
    """The device's tokenizer and the cloud's, as bytes (the device holds both).

    Args:
        device_tok / cloud_tok: the two Hugging Face fast tokenizers.

    Attributes:
        device / cloud: their :class:`ByteVocab`.
        cloud_end: the cloud id a device end-of-generation token proposes: the same end
            token where the cloud has it (``<|im_end|>`` in SmolLM2 and Qwen2.5), else the
            cloud's EOS.

    Raises :class:`VocabError` (a tokenizer whose tokens cannot be spelled as bytes)."""

    def __init__(self, device_tok, cloud_tok):
        self.device_tok, self.cloud_tok = device_tok, cloud_tok
        self.device, self.cloud = token_bytes(device_tok), token_bytes(cloud_tok)
        vocab = cloud_tok.get_vocab()
        eos = cloud_tok.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        self._end_map: dict[int, int] = {}
        for i in self.device.ends:
            piece = device_tok.convert_ids_to_tokens(int(i))
            j = vocab.get(piece, eos if eos is not None else min(self.cloud.ends, default=None))
            if j is not None:
                self._end_map[int(i)] = int(j)
        self.cloud_end = int(eos) if eos is not None else min(self.cloud.ends)

    def end_for_cloud(self, device_id: int) -> int:
        """The cloud's end id for the device's end id ``device_id``."""
        return self._end_map.get(int(device_id), self.cloud_end)

    def cloud_ids(self, data: bytes) -> list[int]:
        """The cloud's ids spelling exactly ``data`` (:func:`encode_bytes`). Raises
        :class:`VocabError` when they cannot."""
        return encode_bytes(self.cloud_tok, self.cloud, data)

    def device_ids(self, data: bytes) -> list[int]:
        """The device's ids spelling exactly ``data``. Raises :class:`VocabError`."""
        return encode_bytes(self.device_tok, self.device, data)


_INVALID = re.compile("([\udc80-\udcff])")


def encode_bytes(tok, vocab: ByteVocab, data: bytes) -> list[int]:
    """``tok``'s ids spelling exactly ``data``: its valid UTF-8 runs encoded by the tokenizer,
    each byte that is not valid UTF-8 as the vocabulary's token of that one byte (byte-level
    BPE has all 256; byte fallback has ``<0xNN>``). Raises :class:`VocabError` when no such
    token exists or the ids do not spell ``data`` back."""
    if not data:
        return []
    ids: list[int] = []
    for part in _INVALID.split(data.decode("utf-8", errors="surrogateescape")):
        if not part:
            continue
        if _INVALID.fullmatch(part):
            one = vocab.by_bytes.get(bytes([ord(part) - 0xDC00]))
            if not one:
                raise VocabError(f"{type(tok).__name__} has no token for the byte {ord(part) - 0xDC00:#04x}")
            ids.append(int(one[0]))
        else:
            ids.extend(encode(tok, part))
    if vocab.join(ids) != data:
        raise VocabError(f"{type(tok).__name__}'s ids do not spell {data[:40]!r} back")
    return ids


class ByteFollower:
    """Keeps a model's token sequence spelling exactly a target byte string.

    ``holder`` has ``tokens`` (a list of ids), ``rollback(n)`` and ``push(id)``: an
    :class:`~edgefuse.cloud.decoding.edge.EdgeLM` or a
    :class:`~edgefuse.cloud.decoding.drafters.Drafter`. Its first ``prompt_len`` ids are the
    prompt and never change; the ids after them are the generated text in ``vocab``.
    :meth:`sync` keeps the longest run of those ids whose bytes are a prefix of the target
    (their KV cache stays) and re-encodes the rest with ``tok``. ``unfed``: the bytes of the
    target after the last complete UTF-8 character that the ids could not spell (the model
    cannot continue them by itself: an unfinished character)."""

    def __init__(self, holder, tok, vocab: ByteVocab, prompt_len: int):
        self.holder, self.tok, self.vocab = holder, tok, vocab
        self.prompt_len = int(prompt_len)
        self.unfed = b""

    def fed(self) -> bytes:
        """The bytes the holder's generated ids spell."""
        return self.vocab.join(self.holder.tokens[self.prompt_len:])

    def sync(self, target: bytes) -> int:
        """Make the holder's generated ids spell ``target`` (up to its last complete
        character; the rest becomes :attr:`unfed`). Returns how many ids were re-encoded
        (0 when the held ones already spell it).

        Raises :class:`VocabError` when the tokenizer cannot spell the text back."""
        gen = self.holder.tokens[self.prompt_len:]
        table = self.vocab.table
        pos, k, best = 0, 0, (0, 0)
        for t in gen:
            b = table[int(t)]
            if not b or target[pos:pos + len(b)] != b:
                break  # a special token (an end) or another text: drop it and what follows
            pos += len(b)
            k += 1
            if utf8_boundary(target[max(pos - 4, 0):pos]) == min(pos, 4):
                best = (k, pos)
        if k == len(gen) and pos == len(target):
            self.unfed = b""
            return 0
        k, pos = best
        rest = target[pos:]
        whole = utf8_boundary(rest)
        ids = encode_bytes(self.tok, self.vocab, rest[:whole])
        self.holder.rollback(self.prompt_len + k)
        for t in ids:
            self.holder.push(int(t))
        self.unfed = rest[whole:]
        return len(ids)


# ---------------------------------------------------------------------------- fusion

@dataclass(frozen=True)
class Candidate:
    """One fusion candidate: ``data`` (its bytes), ``cloud_id`` (its id in the cloud's top-k,
    None for a device token), ``device_id`` (the device token spelling exactly ``data``, if
    any), ``ends`` (it ends the generation), ``edge`` / ``cloud`` (log-probabilities, nats)."""
    data: bytes
    cloud_id: int | None
    device_id: int | None
    ends: bool
    edge: float
    cloud: float


def candidates(edge_logits: torch.Tensor | None, reply: TopK, cross: CrossVocab, k: int) -> list[Candidate]:
    """The candidates of one fused step (module docstring): the cloud's top-k entries (one per
    distinct byte string, its most likely id), then the device's top-``k`` tokens not already
    among them (special tokens other than an end left out), and an end candidate. A token may
    hold part of a UTF-8 character: the other side spells it with its byte tokens.

    Args:
        edge_logits: the device's next-token logits ``[V_device]``; None when the device cannot
            continue by itself (an unfinished character is pending): the cloud's entries only,
            each with edge score ``-inf``.
        reply: the cloud's :class:`~edgefuse.cloud.protocol.TopK` (ids in its vocabulary).
        cross: the two vocabularies.
        k: how many device tokens to add.

    Raises :class:`~edgefuse.cloud.protocol.ProtocolError` for a cloud id outside the cloud's
    vocabulary (a lying cloud)."""
    cv, dv = cross.cloud, cross.device
    ids = np.asarray(reply.ids, dtype=np.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cv.size):
        raise ProtocolError(f"cloud top-k id outside the vocabulary of {cv.size}")
    cloud_lp = reply.logprobs().astype(np.float64)
    cloud_floor = float(reply.tail) - math.log(max(cv.size - len(ids), 1))
    edge = torch.log_softmax(edge_logits.double(), -1) if edge_logits is not None else None
    end_dev = max((float(edge[i]) for i in dv.ends if i < edge.shape[0]), default=-math.inf) \
        if edge is not None else -math.inf

    def edge_score(data: bytes) -> tuple[float, int | None]:
        if edge is None:
            return -math.inf, None
        same = dv.by_bytes.get(data)
        if same:
            j = max(same, key=lambda x: float(edge[x]))
            return float(edge[j]), int(j)
        try:
            first = cross.device_ids(data)[:1]
        except VocabError:
            first = []
        return (float(edge[first[0]]) if first else -math.inf), None

    out: list[Candidate] = []
    seen: set[bytes] = set()
    ends_cloud = -math.inf
    for i, lp in zip(ids.tolist(), cloud_lp.tolist()):
        if i in cv.ends:
            if ends_cloud == -math.inf:
                out.append(Candidate(b"", int(i), None, True, end_dev, lp))
            ends_cloud = max(ends_cloud, lp)
            continue
        data = cv.table[i]
        if data in seen:
            continue  # the same text under another id: the more likely one stands for it
        seen.add(data)
        e, j = edge_score(data)
        out.append(Candidate(data, int(i), j, False, e, lp))
    if edge is None:
        return out
    for j in torch.topk(edge, min(int(k), edge.shape[0])).indices.tolist():
        data = dv.table[j]
        if j in dv.ends:
            if ends_cloud == -math.inf and not any(c.ends for c in out):
                out.append(Candidate(b"", None, int(j), True, float(edge[j]), cloud_floor))
        elif data and data not in seen:
            seen.add(data)
            out.append(Candidate(data, None, int(j), False, float(edge[j]), cloud_floor))
    return out


def fuse_candidates(cands: list[Candidate], w: float) -> tuple[torch.Tensor, int]:
    """Fused log-probabilities over ``cands`` (``float64[n]``, normalised among them) and the
    index of the greedy pick: ``w·edge + (1 − w)·cloud``, ties to a device token when
    ``w ≥ 0.5`` and to a cloud entry otherwise (so ``w = 1`` / ``w = 0`` give the edge's /
    the cloud's own greedy token). A weight of 0 ignores that model entirely (no ``0·-inf``).

    Raises ``ValueError`` for no candidates."""
    if not cands:
        raise ValueError("no fusion candidates")
    e = torch.tensor([c.edge for c in cands], dtype=torch.float64)
    c = torch.tensor([c.cloud for c in cands], dtype=torch.float64)
    score = (w * e if w > 0 else torch.zeros_like(e)) + ((1 - w) * c if w < 1 else torch.zeros_like(c))
    if not torch.isfinite(score).any():
        score = c if w < 1 else e
    fused = torch.log_softmax(score, -1)
    prefer_device = w >= 0.5

    def key(i: int):
        own = (cands[i].device_id is not None) if prefer_device else (cands[i].cloud_id is not None)
        return (float(score[i]), own, -i)

    return fused, max(range(len(cands)), key=key)


__all__ = ["VocabError", "ByteVocab", "token_bytes", "end_ids", "encode", "encode_bytes", "utf8_boundary",
           "CrossVocab", "ByteFollower", "Candidate", "candidates", "fuse_candidates"]
