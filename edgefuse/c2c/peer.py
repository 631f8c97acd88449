"""What a device does in a Cache-to-Cache exchange (no Flower): share, refine, answer.

Roles for one query (the server only relays the sealed bytes; it holds no session key):

- **sharer** (:func:`share_prefill`): prefills its own rendering of the prompt and seals the
  int8 KV cache (:mod:`edgefuse.c2c.exchange`) for the receiver;
- **refiner** (:func:`refine_prefill`, Co-C2C): a sharer that first fuses the receiver's
  cache into its own with its fuser (sharer ← receiver), then seals the refined cache;
- **T2T sharer** (:func:`share_answers`): generates an answer and seals the text;
- **receiver** (:func:`answer_queries`): opens the payloads, checks the declared sharer
  version against the fuser's card, fuses (several sharers through
  :class:`edgefuse.c2c.multi.MultiSharerGate`) and scores MMLU letters or decodes a Dolly answer.

Plaintext of one payload (then sealed with :meth:`SecureSession.seal`)::

    b"EFP1" | u32 little-endian header length | header JSON | body

header: ``{"kind": "kv"|"text", "qid", "spec", "adapter_hash"}`` (the sender's model
version, so a receiver refuses a cache from a model its fuser was not trained for); body: a
:func:`edgefuse.c2c.exchange.encode_kv_cache` blob or UTF-8 text. Sealed frames travel in one flat
``uint8`` array plus their lengths (:func:`pack_frames`).

Timing: ``*_ms`` are wall-clock milliseconds of this process's compute for one query.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch

from edgefuse.privacy.audit import outbound

from edgefuse.data import format_example
from edgefuse.kvcache import fused_forward

from .exchange import decode_kv_cache, encode_kv_cache
from edgefuse.eval.queries import (Query, answer_text, choice_token_ids, greedy_decode, prefill, prompt_split,
                      query_example, score_choices)
from .examples import build_pair_example
from .fuser import control_sharer
from .registry import ModelVersion

MAGIC = b"EFP1"
MAX_HEADER_BYTES = 4096


class PeerPayloadError(ValueError):
    """A relayed payload that is malformed, for another query, or from an unexpected model."""


@dataclass
class Payload:
    """One opened payload: the sender's declared version, the query id, and the body."""

    kind: str
    qid: str
    sender: ModelVersion
    body: bytes


def encode_payload(kind: str, qid: str, sender: ModelVersion, body: bytes) -> bytes:
    """The plaintext of one payload (see the module docstring)."""
    header = json.dumps({"kind": kind, "qid": qid, "spec": sender.spec,
                         "adapter_hash": sender.adapter_hash}).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + body
    outbound("kv" if kind == "kv" else "answer_text", data)  # the outbound audit, before sealing
    return data


def decode_payload(data: bytes) -> Payload:
    """Inverse of :func:`encode_payload`.

    Raises:
        PeerPayloadError: wrong magic, a header length past the data or over
            :data:`MAX_HEADER_BYTES`, a header that is not the expected JSON object.
    """
    if len(data) < 8 or data[:4] != MAGIC:
        raise PeerPayloadError("not an edgefuse peer payload (bad magic or too short)")
    (n,) = struct.unpack("<I", data[4:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise PeerPayloadError(f"peer payload header length {n} is invalid for {len(data)} bytes")
    try:
        h = json.loads(data[8:8 + n])
        payload = Payload(str(h["kind"]), str(h["qid"]), ModelVersion(h["spec"], h["adapter_hash"]),
                          bytes(data[8 + n:]))
    except (ValueError, KeyError, TypeError) as e:
        raise PeerPayloadError(f"peer payload header is malformed: {e}") from None
    if payload.kind not in ("kv", "text"):
        raise PeerPayloadError(f"unknown peer payload kind {payload.kind!r}")
    return payload


def pack_frames(frames: list[bytes]) -> tuple[np.ndarray, list[int]]:
    """Concatenate sealed frames into one ``uint8`` array; return it and the frame lengths."""
    lengths = [len(f) for f in frames]
    flat = np.frombuffer(b"".join(frames), dtype=np.uint8).copy() if frames else np.zeros(0, np.uint8)
    return flat, lengths


def unpack_frames(flat: np.ndarray, lengths: list[int]) -> list[bytes]:
    """Inverse of :func:`pack_frames`.

    Raises:
        PeerPayloadError: lengths that are negative or do not add up to the array's size.
    """
    flat = np.asarray(flat)
    if flat.dtype != np.uint8 or flat.ndim != 1:
        raise PeerPayloadError(f"frames must be a 1-D uint8 array, got {flat.dtype} {flat.shape}")
    if any(int(n) < 0 for n in lengths) or sum(int(n) for n in lengths) != flat.size:
        raise PeerPayloadError(f"frame lengths add up to {sum(int(n) for n in lengths)}, "
                               f"the array has {flat.size} bytes")
    out, pos, data = [], 0, flat.tobytes()
    for n in lengths:
        out.append(data[pos:pos + int(n)])
        pos += int(n)
    return out


def _ms(t0: float) -> float:
    return 1000.0 * (time.perf_counter() - t0)


def _ids(ids: list[int], model) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)


def pair_example(query: Query, receiver_tok, sharer_tok, max_prompt_tokens: int):
    """The :class:`edgefuse.c2c.examples.PairExample` of a query (no response): both sides' prompt
    tokens and the alignment, exactly as fusers were trained.

    Raises:
        PeerPayloadError: nothing of the prompt is usable for fusion.
    """
    ex = build_pair_example(query_example(query), receiver_tok, sharer_tok, max_prompt_tokens + 1)
    if ex is None:
        raise PeerPayloadError(f"query {query.qid}: the prompts cannot be aligned for fusion")
    return ex


@torch.no_grad()
def share_prefill(session, model, tok, me: ModelVersion, queries: list[Query], receiver_tok,
                  max_prompt_tokens: int) -> tuple[list[bytes], list[float]]:
    """Sharer: prefill each query's prompt (this model's own rendering, all its tokens) and
    seal the int8 KV cache for the receiver. Returns ``(frames, prefill_ms per query)``."""
    frames, times = [], []
    for q in queries:
        t0 = time.perf_counter()
        ex = pair_example(q, receiver_tok, tok, max_prompt_tokens)
        cache = model(_ids(ex.sharer_prompt_ids, model), use_cache=True).cache
        blob = encode_kv_cache(cache)
        times.append(_ms(t0))
        frames.append(session.seal(encode_payload("kv", q.qid, me, blob)))
    return frames, times


def open_payloads(session, frames: list[bytes], queries: list[Query], kind: str,
                  expect: ModelVersion | None = None) -> list[Payload]:
    """Open one sealed frame per query, in order, and check each payload's kind, query id
    and (when given) the sender's declared version.

    Raises:
        edgefuse.transport.crypto.FrameError: a tampered, replayed or reordered frame.
        PeerPayloadError: fewer frames than queries, or a payload for another query, kind
            or model version.
    """
    if len(frames) != len(queries):
        raise PeerPayloadError(f"{len(frames)} payloads for {len(queries)} queries")
    out = []
    for q, frame in zip(queries, frames):
        p = decode_payload(session.open(frame))
        if p.qid != q.qid or p.kind != kind:
            raise PeerPayloadError(f"payload is a {p.kind!r} for query {p.qid!r}, expected a "
                                   f"{kind!r} for {q.qid!r}")
        if expect is not None and p.sender != expect:
            raise PeerPayloadError(f"payload for {q.qid} comes from {p.sender}, the fuser was "
                                   f"trained for {expect}: refusing to fuse it")
        out.append(p)
    return out


@torch.no_grad()
def refine_prefill(session_in, session_out, model, tok, me: ModelVersion, queries: list[Query],
                   frames: list[bytes], fuser, partner_tok, expect: ModelVersion,
                   max_prompt_tokens: int) -> tuple[list[bytes], list[float]]:
    """Co-C2C refiner: fuse the partner's cache into this model's full-prompt cache with
    ``fuser`` (this model ← partner), then seal the refined cache for the partner.

    Returns ``(frames, ms per query)`` (prefill + open + fuse + encode).
    """
    incoming = open_payloads(session_in, frames, queries, "kv", expect)
    out, times = [], []
    for q, p in zip(queries, incoming):
        t0 = time.perf_counter()
        ex = pair_example(q, tok, partner_tok, max_prompt_tokens)
        ids = ex.receiver_prompt_ids + ex.continuation_ids[:1]  # the whole prompt, as a sharer
        cache = model(_ids(ids, model), use_cache=True).cache
        fused = fuser(cache, decode_kv_cache(p.body), ex.mapping + [[]])
        blob = encode_kv_cache(fused)
        times.append(_ms(t0))
        out.append(session_out.seal(encode_payload("kv", q.qid, me, blob)))
    return out, times


@torch.no_grad()
def share_answers(session, model, tok, me: ModelVersion, queries: list[Query],
                  max_prompt_tokens: int, max_new_tokens: int) -> tuple[list[bytes], list[float]]:
    """T2T sharer: generate this model's answer to each query and seal the text.

    Returns ``(frames, prefill + decode ms per query)``."""
    frames, times = [], []
    eos = _eos_ids(tok, model)
    for q in queries:
        t0 = time.perf_counter()
        prefill_ids, last = prompt_split(q, tok, max_prompt_tokens)
        ids = greedy_decode(model, prefill(model, prefill_ids), last, max_new_tokens, eos)
        text = answer_text(tok, ids)
        times.append(_ms(t0))
        frames.append(session.seal(encode_payload("text", q.qid, me, text.encode())))
    return frames, times


def _eos_ids(tok, model) -> set[int]:
    ids = {tok.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(e) for e in extra)
    return {i for i in ids if i is not None}


CONTROL_OF_MODE = {"c2c": "none", "c2c_zero": "zero", "c2c_shuffled": "shuffled"}
"""The sharer control (:func:`edgefuse.c2c.fuser.control_sharer`) of each fused pair mode."""


def shuffled_partners(n: int) -> list[int]:
    """The shuffled-sharer control's partner of each query of a chunk of ``n``: query ``k``
    is fused with the sharer cache received for query ``(k + 1) % n`` (a rotation by one: a
    derangement, so no query gets its own sharer cache, and the same for the same chunk).

    Raises:
        PeerPayloadError: ``n < 2`` (no other query to take a cache from).
    """
    if n < 2:
        raise PeerPayloadError(f"the shuffled-sharer control needs at least 2 queries in a message, got {n}")
    return [(k + 1) % n for k in range(n)]


def response_ids(query: Query, tok, max_tokens: int) -> list[int]:
    """The reference response's token ids as fusers are trained on them
    (:func:`edgefuse.data.tokenize_parts`: the stripped response + EOS, no special tokens),
    cut to ``max_tokens``; ``[]`` when the query has no reference."""
    if not query.reference:
        return []
    _, response = format_example({"instruction": query.instruction, "context": query.context,
                                  "response": query.reference}, tok)
    return tok(response, add_special_tokens=False)["input_ids"][:max(int(max_tokens), 0)]


@torch.no_grad()
def response_nll(model, cache, last_id: int, response: list[int]) -> tuple[float, int]:
    """Teacher-forced NLL of ``response`` after a (fused) prompt cache, the fusers' training
    loss (:mod:`edgefuse.c2c.train`): the continuation ``[last_id] + response`` runs on a copy
    of ``cache`` (unchanged), and each response token is scored at the position before it.

    Returns:
        ``(mean nats per response token, tokens)``; ``(nan, 0)`` for an empty response.
    """
    if not response:
        return float("nan"), 0
    x = torch.tensor([[last_id] + list(response)], dtype=torch.long, device=next(model.parameters()).device)
    logits = fused_forward(model, cache, x, copy=True)
    target = x[0, 1:]
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), target, reduction="sum")
    return float(nll) / len(response), len(response)


@torch.no_grad()
def answer_queries(model, tok, queries: list[Query], *, sharers: list[dict] | None = None,
                   gate=None, hints: dict[str, str] | None = None, max_prompt_tokens: int,
                   max_new_tokens: int, nll_max_tokens: int = 0) -> list[dict]:
    """Receiver: answer each query alone, with T2T hints, or from a fused cache.

    Args:
        sharers: per sharer ``{"fuser": C2CFuser, "tok": sharer tokenizer, "payloads":
            [Payload per query], "control": "none" | "zero" | "shuffled"}`` (``control``
            optional, ``none``: the fuser reads this query's sharer cache; ``zero``: all
            zeros of its shapes; ``shuffled``: the cache of query :func:`shuffled_partners`
            ``[k]`` of this call, the mapping rescaled; :func:`edgefuse.c2c.fuser.control_sharer`);
            ``None`` or empty: no fusion.
        gate: a :class:`edgefuse.c2c.multi.MultiSharerGate` for several sharers (``None``: equal
            weights).
        hints: ``qid -> sharer answer`` for T2T (added to the prompt as context).
        nll_max_tokens: with ``> 0``, every query with a reference (Dolly, GSM8K) also gets
            the :func:`response_nll` of its first ``nll_max_tokens`` reference tokens
            (:func:`response_ids`) on the same (fused) prompt cache.

    Returns:
        Per query ``{"qid", "pred" (MMLU choice or None), "text" (Dolly answer or None; a
        GSM8K query is scored by its NLL only), "nll" (mean nats per reference token or
        None), "nll_tokens", "prefill_ms", "fuse_ms", "decode_ms"}``.

    Raises:
        PeerPayloadError: a shuffled control with fewer than 2 queries.
    """
    from .multi import fuse_many
    from edgefuse.eval.queries import t2t_hint

    sharers = sharers or []
    partners = (shuffled_partners(len(queries))
                if any(s.get("control") == "shuffled" for s in sharers) else None)
    letters = choice_token_ids(tok)
    eos = _eos_ids(tok, model)
    out = []
    for k, q in enumerate(queries):
        t0 = time.perf_counter()
        fuse_ms = 0.0
        if sharers:
            exs = [pair_example(q, tok, s["tok"], max_prompt_tokens) for s in sharers]
            prefill_ids, last = exs[0].receiver_prompt_ids, exs[0].continuation_ids[0]
            cache = prefill(model, prefill_ids)
            prefill_ms = _ms(t0)
            t1 = time.perf_counter()
            fused = []
            for s, ex in zip(sharers, exs):
                control = s.get("control", "none")
                partner = decode_kv_cache(s["payloads"][partners[k]].body) if control == "shuffled" else None
                s_cache, mapping = control_sharer(control, decode_kv_cache(s["payloads"][k].body),
                                                  ex.mapping, partner)
                fused.append(s["fuser"](cache, s_cache, mapping))
            cache = fused[0] if len(fused) == 1 else fuse_many(cache, fused, gate)
            fuse_ms = _ms(t1)
        else:
            asked = t2t_hint(q, hints[q.qid]) if hints else q
            prefill_ids, last = prompt_split(asked, tok, max_prompt_tokens)
            cache = prefill(model, prefill_ids)
            prefill_ms = _ms(t0)
        pred = text = nll = None
        n_nll = 0
        if nll_max_tokens > 0 and q.kind != "mmlu":  # scoring, not answering: not in the timings
            value, n_nll = response_nll(model, cache, last, response_ids(q, tok, nll_max_tokens))
            nll = value if n_nll else None
        t2 = time.perf_counter()
        if q.kind == "mmlu":
            pred, _ = score_choices(model, cache, last, letters)
        elif q.kind == "dolly":
            text = answer_text(tok, greedy_decode(model, cache, last, max_new_tokens, eos))
        out.append({"qid": q.qid, "pred": pred, "text": text, "nll": nll, "nll_tokens": n_nll,
                    "prefill_ms": prefill_ms, "fuse_ms": fuse_ms, "decode_ms": _ms(t2)})
    return out


__all__ = ["MAGIC", "Payload", "PeerPayloadError", "encode_payload", "decode_payload",
           "pack_frames", "unpack_frames", "pair_example", "share_prefill", "open_payloads",
           "refine_prefill", "share_answers", "answer_queries", "CONTROL_OF_MODE", "shuffled_partners",
           "response_ids", "response_nll"]
