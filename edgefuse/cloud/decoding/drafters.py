"""Drafters for speculative decoding on the device, behind one interface.

:class:`Drafter` is the device's half of speculative decoding: it proposes γ tokens (and,
for sampled verification, the sparse distribution q each was drawn from), is told what the
cloud kept (:meth:`Drafter.observe`) and rolls back what it rejected. The idea follows
transformers' ``generation/candidate_generator.py`` (one ``CandidateGenerator`` with
``get_candidates`` / ``update_candidate_strategy``, one subclass per strategy): the decoding
loop (:class:`edgefuse.cloud.decoding.decoder.Decoder`) holds a drafter and never asks which.
Each subclass registers itself under its name in :data:`DRAFTERS` (``cloud.decode.drafter``)
and builds itself from a :class:`DrafterSpec`, so adding one needs no central edit:

* ``full_head`` (:class:`FullHeadDrafter`): the edge model with its full LM head.
* ``pruned_head`` (:class:`PrunedHeadDrafter`): the edge model with a **frequency-ranked
  head** (FR-Spec: Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via
  Frequency-Ranked Speculative Sampling", ACL 2025, arXiv:2502.14856): the draft scores only
  the ``N`` most frequent tokens of a public corpus, so its head is ``N x H`` instead of
  ``V x H``. :func:`frequent_token_ids` picks the ids, :class:`DraftHead` applies the head.
* ``shallow`` (:class:`ShallowDrafter`): early exit without training, the first ``L``
  decoder layers, the final norm and the head (:func:`shallow_model` shares the weights).
* ``ngram`` (:class:`NgramDrafter`): **prompt lookup** (Saxena, "Prompt Lookup Decoding",
  2023, github.com/apoorvumang/prompt-lookup-decoding): the tokens that followed the most
  recent earlier occurrence of the context's last n tokens. No model at all; it pays off
  where outputs copy from the prompt.

Why cheaper drafts: on a CPU core the draft's per-token cost is memory bound (every weight
is read once per token), and Qwen2.5's 151,936 x 896 LM head is 136 M of the ~494 M weights
the 0.5B draft reads per token (fp32: 0.54 GB of ~2 GB; the input embedding reads one row).
On one core that is ~29 of ~110 ms per token; the 24 decoder layers are the rest.
``bench/bench_draft.py`` measures each.

None of them can change what speculative decoding outputs. Greedy verification keeps a
drafted token only when it equals the target's own argmax, and speculative sampling
(Leviathan et al. 2023) accepts/resamples against the target distribution p for *any*
draft distribution q, provided the drafted token really was drawn from the q that is sent:
the committed tokens are then distributed exactly as the target's. A draft restricted to a
vocabulary subset is such a q (zero mass outside the subset; a token it never proposes
still comes out of the residual max(p - q, 0)); prompt lookup's token is a deterministic
function of the context, i.e. drawn from the one-hot q = δ_x, which it sends (accepted with
probability p(x), else the token is resampled from p without x: p again). So a drafter only
changes how many tokens each round trip commits (the acceptance rate), never the text.
"""

from __future__ import annotations

import copy
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from edgefuse.cloud.decoding.batcher import DraftBatcher
from edgefuse.cloud.decoding.edge import EdgeLM
from edgefuse.cloud.speculative import draft_q, sample_sparse, sparse_q

FREQ_CACHE_FORMAT = "edgefuse.frequent_token_ids/1"


# ------------------------------------------------------------------ frequent token ids

def always_kept_ids(tok) -> set[int]:
    """Ids a pruned draft head must never lose: every special / added token (``<|im_end|>``,
    ``<|endoftext|>``, the FIM and tool tokens ...) and every token the chat template writes
    around the messages (``<|im_start|>``, ``system``, ``user``, ``assistant``, newlines, a
    default system prompt).

    Returns:
        a set of token ids (all ``< len(tok)``).
    """
    ids = {int(i) for i in tok.all_special_ids if i is not None}
    ids.update(int(i) for i in getattr(tok, "added_tokens_decoder", {}) or {})
    if getattr(tok, "chat_template", None):
        convs = ([{"role": "system", "content": ""}, {"role": "user", "content": ""},
                  {"role": "assistant", "content": ""}],
                 [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
        for conv in convs:
            for msgs, gen in ((conv, False), (conv[:-1], True)):
                try:
                    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                except Exception:  # noqa: BLE001 - some templates refuse a system turn
                    continue
                ids.update(tok(text, add_special_tokens=False)["input_ids"])
    return {i for i in ids if 0 <= i < len(tok)}


def _vocab_fingerprint(tok) -> str:
    h = hashlib.sha256()
    for piece, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{piece}\n".encode())
    return h.hexdigest()[:16]


def _corpus_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "big"))
        h.update(b)
    return h.hexdigest()


def token_counts(tok, texts: Sequence[str], batch: int = 512) -> np.ndarray:
    """How often each token id occurs in ``texts`` (tokenized without added special tokens:
    pass chat-templated texts to count the template's tokens too).

    Returns:
        int64 array of shape ``[len(tok)]``.
    """
    counts = np.zeros(len(tok), dtype=np.int64)
    for i in range(0, len(texts), batch):
        for ids in tok(list(texts[i:i + batch]), add_special_tokens=False)["input_ids"]:
            if ids:
                counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(tok))[:len(tok)]
    return counts


def frequent_token_ids(tok, texts: Iterable[str], n: int,
                       cache_path: str | Path | None = None) -> torch.Tensor:
    """The ``n`` token ids a frequency-pruned draft head keeps (FR-Spec, Zhao et al. 2025).

    FR-Spec restricts the draft's LM head to the most frequent tokens of a corpus (token
    frequencies are long-tailed: a few thousand ids cover almost all running text), cutting
    the head's cost by ``V / n`` while verification keeps the output exact. Here: the ids of
    :func:`always_kept_ids` (special, added and chat-template tokens) first, then the ids
    with the highest counts over ``texts`` (ties: lower id first; ids never seen follow in id
    order, which for byte-level BPE is roughly merge order, i.e. frequency in the
    tokenizer's own training corpus). Use a public corpus only, never evaluation prompts.

    Args:
        tok: a Hugging Face tokenizer.
        texts: the corpus, e.g. chat-templated public prompts + responses.
        n: how many ids to keep; ``n >= len(tok)`` keeps them all.
        cache_path: optional JSON file. When it holds the result for the same tokenizer
            (vocabulary fingerprint), corpus (sha256 of the texts) and ``n``, it is returned
            without tokenizing; otherwise the result is computed and written there
            atomically.

    Returns:
        LongTensor ``[min(n, len(tok))]`` of distinct ids, sorted ascending.

    Raises:
        ValueError: ``n`` is smaller than the number of always-kept ids.
    """
    texts = list(texts)
    meta = {"format": FREQ_CACHE_FORMAT, "n": int(n), "tokenizer": _vocab_fingerprint(tok),
            "corpus_sha256": _corpus_digest(texts), "corpus_texts": len(texts)}
    if cache_path is not None and Path(cache_path).is_file():
        try:
            cached = json.loads(Path(cache_path).read_text())
            if all(cached.get(k) == v for k, v in meta.items()):
                return torch.tensor(cached["ids"], dtype=torch.long)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale: recompute and overwrite
    V = len(tok)
    forced = always_kept_ids(tok)
    n_keep = min(int(n), V)
    if n_keep < len(forced):
        raise ValueError(f"n={n} is below the {len(forced)} special/chat-template ids that "
                         "are always kept")
    counts = token_counts(tok, texts)
    order = np.lexsort((np.arange(V), -counts))  # by count desc, then id asc
    keep = set(forced)
    for i in order:
        if len(keep) >= n_keep:
            break
        keep.add(int(i))
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    if cache_path is not None:
        from edgefuse.io import atomic_write_json

        atomic_write_json(cache_path, {**meta, "ids": ids.tolist()})
    return ids


# ------------------------------------------------------------------ pruned LM head

class DraftHead:
    """The LM head of a causal LM restricted to ``keep_ids`` (all rows when None).

    The kept rows of the output-embedding weight (tied to the input embedding or not) are
    copied once here (``N x H`` floats); the model itself is left untouched. Logit
    soft-capping (Gemma) is applied as the model does.

    A pruned head changes only which tokens the draft can propose, so only the acceptance
    rate: verification by the target makes the output identical to the target's own
    (greedy) or identically distributed (sampling), see the module docstring.

    Attributes:
        keep_ids: LongTensor ``[N]`` of vocabulary ids, or None (full vocabulary).
        size: ``N`` (or the model's vocabulary size ``V``).
    """

    def __init__(self, model, keep_ids: torch.Tensor | None = None):
        head = model.get_output_embeddings()
        if head is None or getattr(head, "weight", None) is None:
            raise ValueError(f"{type(model).__name__} has no output embedding (LM head)")
        w = head.weight.detach()
        b = getattr(head, "bias", None)
        b = None if b is None else b.detach()
        if keep_ids is not None:
            keep_ids = torch.as_tensor(keep_ids, dtype=torch.long).flatten()
            if keep_ids.numel() == 0 or keep_ids.min() < 0 or keep_ids.max() >= w.shape[0]:
                raise ValueError(f"keep_ids must be non-empty ids in [0, {w.shape[0]})")
            w = w.index_select(0, keep_ids.to(w.device)).contiguous()
            b = None if b is None else b.index_select(0, keep_ids.to(b.device)).contiguous()
        self.keep_ids = keep_ids
        self.weight, self.bias = w, b
        self.size = int(w.shape[0])
        self.vocab_size = int(head.weight.shape[0])
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self._lut: torch.Tensor | None = None  # vocabulary id -> column, built on first use

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the kept ids.

        Args:
            hidden: final-normed hidden states ``[B, T, H]`` (the body's last_hidden_state).

        Returns:
            ``[B, T, N]`` (``[B, T, V]`` without keep_ids); column ``j`` scores
            ``to_vocab(j)``.
        """
        out = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def to_vocab(self, idx: torch.Tensor | int) -> torch.Tensor:
        """Vocabulary ids of head columns ``idx`` (any shape; identity without keep_ids)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        return idx if self.keep_ids is None else self.keep_ids[idx]

    def from_vocab(self, token_ids: torch.Tensor | int) -> torch.Tensor:
        """Head columns of vocabulary ids (any shape), ``-1`` where an id is not kept."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if self.keep_ids is None:
            return token_ids
        if self._lut is None:
            self._lut = torch.full((self.vocab_size,), -1, dtype=torch.long)
            self._lut[self.keep_ids] = torch.arange(self.size)
        return self._lut[token_ids]

    @torch.no_grad()
    def forward_last(self, model, input_ids: torch.Tensor, cache=None, **kwargs):
        """Run the transformer body once (``model.model``) and the pruned head on the last
        position only (the ``T - 1`` other positions never touch the head).

        Args:
            model: the causal LM, or a :func:`shallow_model` view of it.
            input_ids: LongTensor ``[B, T]``: the tokens not yet in the cache.
            cache: the KV cache of the tokens before them (a transformers
                ``Cache``, updated in place), or None to start one.
            **kwargs: passed to the body (``attention_mask``, ``position_ids``).

        Returns:
            ``(logits [B, N], cache)``: logits over the kept ids at the last position, and
            the cache now holding the ``T`` new positions too.
        """
        out = model.model(input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
        return self.logits(out.last_hidden_state[:, -1:])[:, 0], out.cache


# ------------------------------------------------------------------ shallow draft

def shallow_model(model, num_layers: int):
    """A view of ``model`` that runs only its first ``num_layers`` decoder layers, then the
    final norm and the LM head (early exit, no training). Shares every weight: no copy.

    The returned object is a shallow copy of the causal LM with its own config
    (``num_hidden_layers = num_layers``, ``layer_types`` cut to match) and a body whose
    layer list holds the first ``num_layers`` layer modules; ``shallow(input_ids)`` and
    :meth:`DraftHead.forward_last` work on it as on the full model, with a KV cache of
    ``num_layers`` layers. Its layer-``i`` cache equals the full model's. A PEFT model (a
    device's model with its LoRA attached) gives a view of its base model, whose layers
    carry the adapter.

    Raises:
        ValueError: ``num_layers`` not in ``[1, num_hidden_layers]``, or a model with no
            ``model.layers`` decoder stack.
    """
    if hasattr(model, "get_base_model"):  # peft.PeftModel: the LoRA layers live in the base
        model = model.get_base_model()
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers decoder stack")
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    cfg = copy.deepcopy(body.config)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    cfg.num_hidden_layers = num_layers
    new_body = copy.copy(body)
    new_body._modules = dict(body._modules)  # own module table: the original keeps all layers
    new_body._modules["layers"] = nn.ModuleList(list(layers)[:num_layers])
    new_body.config = cfg
    new = copy.copy(model)
    new._modules = dict(model._modules)
    new._modules["model"] = new_body
    new.config = cfg
    return new


# ------------------------------------------------------------------ the drafter interface

@dataclass
class Draft:
    """Drafted tokens and, for sampled verification, the sparse q each was drawn from.

    Attributes:
        ids: the drafted vocabulary ids, in order.
        q: per drafted id ``(ids int64[k], probs float16[k])``: the distribution it was
            sampled from, as sent on the wire (normalised by
            :func:`edgefuse.cloud.speculative.sparse_q` on both ends); empty at temperature 0.
    """
    ids: list[int] = field(default_factory=list)
    q: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def extend(self, other: "Draft") -> None:
        """Append ``other``'s tokens (and their q) after these."""
        self.ids += other.ids
        self.q += other.q


DRAFTERS: dict[str, type["Drafter"]] = {}  # cloud.decode.drafter name -> class


def register(cls: type["Drafter"]) -> type["Drafter"]:
    """Class decorator: make ``cls`` selectable as ``cloud.decode.drafter: <cls.name>``."""
    DRAFTERS[cls.name] = cls
    return cls


class Drafter(ABC):
    """Proposes draft tokens for speculative decoding; the loop that verifies them does not
    know which drafter it holds (transformers' ``CandidateGenerator`` idea).

    State: :attr:`tokens`, the ids the next proposal continues: the first :attr:`committed`
    are verified (prompt + committed output), the rest are proposals not yet verified. The
    loop calls :meth:`start` once per generation, :meth:`propose` for each block (several
    calls extend one block, e.g. the look-ahead of ``spec_async``), :meth:`observe` with
    the cloud's answer to the oldest unverified block, and :meth:`rollback` to drop
    proposals it will not send.

    Lossless whatever the drafter: at temperature 0 a proposal can be anything (greedy
    verification keeps a token only if it equals the target's argmax); at temperature > 0
    every proposed token must have been drawn from the q returned with it (see the module
    docstring), which each subclass guarantees.
    """

    name: ClassVar[str]
    needs_head: ClassVar[bool] = False  # built with a pruned DraftHead (devices.pruned_head)

    def __init__(self):
        self.committed = 0

    @property
    @abstractmethod
    def tokens(self) -> list[int]:
        """Committed ids, then the unverified proposals (do not modify)."""

    @abstractmethod
    def _start(self, prompt: list[int]) -> None:
        """Hold exactly ``prompt`` (prefill a model here)."""

    @abstractmethod
    def propose(self, gamma: int, temperature: float = 0.0, kq: int = 16,
                gen: torch.Generator | None = None) -> Draft:
        """Up to ``gamma`` tokens after :attr:`tokens`, which then holds them too.

        Args:
            gamma: how many to propose (a drafter may propose fewer, or none).
            temperature: 0 = greedy drafts and no q; > 0: each token drawn from its q.
            kq: the most ids a model drafter's sparse q keeps (its top-``kq``).
            gen: the generator the draws use (the device's session generator).
        """

    @abstractmethod
    def _rollback(self, length: int) -> None:
        """Keep the first ``length`` ids of :attr:`tokens` (crop a KV cache to match)."""

    @abstractmethod
    def push(self, token: int) -> None:
        """Append ``token`` (the target's) to :attr:`tokens`."""

    def start(self, prompt: list[int]) -> None:
        """Begin a generation after ``prompt`` (all of it committed)."""
        self._start(list(prompt))
        self.committed = len(prompt)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` ids of :attr:`tokens` (drop unverified proposals)."""
        self._rollback(length)
        self.committed = min(self.committed, length)

    def observe(self, accepted: int, token: int) -> int:
        """The cloud's answer to the oldest unverified block: its first ``accepted`` tokens
        were kept and the target's ``token`` follows them (the ``update_candidate_strategy``
        hook); all of them become committed. The proposals after the kept ones are dropped,
        unless the first of them equals ``token``: then it and what was proposed on top of it
        stay (``spec_async``'s look-ahead, drafted on a right guess of ``token``).

        Returns:
            how many proposals stay unverified after the new committed ids.

        Raises:
            ValueError: ``accepted`` exceeds the proposals held.
        """
        keep = self.committed + int(accepted)
        toks = self.tokens
        if not (0 <= accepted and keep <= len(toks)):
            raise ValueError(f"accepted={accepted} but {len(toks) - self.committed} proposals held")
        if not (keep < len(toks) and toks[keep] == int(token)):
            self.rollback(keep)
            self.push(int(token))
        self.committed = keep + 1
        return len(self.tokens) - self.committed

    @classmethod
    @abstractmethod
    def build(cls, spec: "DrafterSpec", edge: EdgeLM, head: "DraftHead | None",
              shared: dict) -> "Drafter":
        """The drafter of ``spec`` for a device whose model is ``edge``; ``shared`` is one
        dict per :func:`drafter_factory` (what devices sharing a model share)."""


def sample_draft(logits: torch.Tensor, keep: torch.Tensor | None, temperature: float, kq: int,
                 gen: torch.Generator | None) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
    """One drafted id from next-token ``logits`` (``[V]``, or ``[N]`` over the vocabulary ids
    ``keep``): the argmax at temperature 0 (no q); else ``(ids, probs)`` =
    :func:`~edgefuse.cloud.speculative.draft_q` (top-``kq``, float16, as sent) and an id drawn
    from exactly that q (:func:`~edgefuse.cloud.speculative.sparse_q`)."""
    if temperature == 0:
        i = int(torch.argmax(logits))
        return (int(keep[i]) if keep is not None else i), None
    ids, probs = draft_q(logits, temperature, kq)
    if keep is not None:
        ids = keep[torch.as_tensor(ids)].numpy().astype(np.int64)
    q_ids, q = sparse_q(ids, probs)
    return sample_sparse(q_ids, q, gen), (ids, probs)


class ModelDrafter(Drafter):
    """Drafts with a language model over its rollback-able KV cache (an :class:`EdgeLM`),
    one forward of one token per drafted token; ``head``: a :class:`DraftHead` scoring only
    its kept ids (None: the model's full head)."""

    def __init__(self, lm: EdgeLM, head: "DraftHead | None" = None):
        super().__init__()
        self.lm, self.head = lm, head

    @property
    def tokens(self) -> list[int]:
        return self.lm.tokens

    def _start(self, prompt: list[int]) -> None:
        self.lm.start(prompt)

    def _rollback(self, length: int) -> None:
        self.lm.rollback(length)

    def push(self, token: int) -> None:
        self.lm.push(token)

    @torch.no_grad()
    def propose(self, gamma, temperature=0.0, kq=16, gen=None) -> Draft:
        out = Draft()
        for _ in range(max(int(gamma), 0)):
            if self.head is None:
                logits, keep = self.lm.logits(), None
            else:
                logits = self.head.logits(self.lm.hidden().view(1, 1, -1))[0, 0].float()
                keep = self.head.keep_ids
            t, q = sample_draft(logits, keep, temperature, kq, gen)
            self.lm.push(t)
            out.ids.append(t)
            if q is not None:
                out.q.append(q)
        return out


@register
class FullHeadDrafter(ModelDrafter):
    """The edge model with its full LM head drafts (sharing the edge's KV cache)."""

    name = "full_head"

    def __init__(self, lm: EdgeLM):
        super().__init__(lm)

    @classmethod
    def build(cls, spec, edge, head, shared):
        return cls(edge)


@register
class PrunedHeadDrafter(ModelDrafter):
    """The edge model with a frequency-ranked pruned head (FR-Spec, :class:`DraftHead`)
    drafts, sharing the edge's KV cache; it can propose only the head's kept ids."""

    name = "pruned_head"
    needs_head = True

    def __init__(self, lm: EdgeLM, head: "DraftHead"):
        if head is None:
            raise ValueError("the pruned_head drafter needs its DraftHead "
                             "(edgefuse.cloud.devices.pruned_head)")
        super().__init__(lm, head)

    @classmethod
    def build(cls, spec, edge, head, shared):
        return cls(edge, head)


@register
class ShallowDrafter(ModelDrafter):
    """The first ``L`` decoder layers of the edge model, its final norm and full head draft
    (:func:`shallow_model`: the weights are shared, the KV cache of ``L`` layers is its own).
    """

    name = "shallow"

    def __init__(self, lm: EdgeLM):
        super().__init__(lm)

    @classmethod
    def of(cls, model, tok, num_layers: int, batcher: DraftBatcher | None = None) -> "ShallowDrafter":
        """A shallow drafter over the first ``num_layers`` layers of ``model``. Raises
        ``ValueError`` for a layer count outside ``[1, num_hidden_layers]``."""
        return cls(EdgeLM(shallow_model(model, num_layers), tok, batcher=batcher))

    @classmethod
    def build(cls, spec, edge, head, shared):
        key = ("shallow", id(edge.model), spec.shallow_layers)
        if key not in shared:  # one view (and one batcher, if the edge batches) per model
            view = shallow_model(edge.model, spec.shallow_layers)
            b = edge.batcher
            shared[key] = (view, None if b is None else DraftBatcher(view, b.pad_id, 1000 * b.max_wait_s))
        view, batcher = shared[key]
        return cls(EdgeLM(view, edge.tok, batcher=batcher))


@register
class NgramDrafter(Drafter):
    """Prompt-lookup decoding (Saxena 2023): draft by copying from the context.

    For ``n`` from ``max_n`` down to ``min_n``: find the most recent earlier occurrence of
    the last ``n`` tokens (prompt + generated so far) and propose up to ``gamma`` tokens
    that followed it (:meth:`lookup`). Costs a few microseconds per call and no model. A
    proposal is a deterministic function of the context, so at temperature > 0 its q is
    one-hot (``q(x) = 1``, exact in float16): the cloud accepts ``x`` with probability
    ``p(x)`` and otherwise resamples from ``p`` without ``x``, which is ``p`` again.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        super().__init__()
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._tokens: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def _start(self, prompt: list[int]) -> None:
        self._tokens = [int(t) for t in prompt]

    def _rollback(self, length: int) -> None:
        del self._tokens[length:]

    def push(self, token: int) -> None:
        self._tokens.append(int(token))

    def lookup(self, tokens: Sequence[int], gamma: int) -> list[int]:
        """Proposed continuation of ``tokens``.

        Returns:
            at most ``gamma`` token ids (fewer when the match is near the end of
            ``tokens``); ``[]`` when no suffix of length ``>= min_n`` occurred before.
        """
        L = len(tokens)
        if gamma <= 0 or L < self.min_n + 1:
            return []
        a = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            starts = L - n  # candidate starts j in [0, L - n): earlier than the suffix itself
            mask = a[:starts] == a[L - n]
            for k in range(1, n):
                mask &= a[k:starts + k] == a[L - n + k]
            hits = np.flatnonzero(mask)
            if hits.size:
                j = int(hits[-1]) + n
                return a[j:j + gamma].tolist()
        return []

    def propose(self, gamma, temperature=0.0, kq=16, gen=None) -> Draft:
        ids = self.lookup(self._tokens, int(gamma))
        self._tokens += ids
        q = [(np.array([t], np.int64), np.ones(1, np.float16)) for t in ids] if temperature > 0 else []
        return Draft(ids, q)

    @classmethod
    def build(cls, spec, edge, head, shared):
        return cls(spec.ngram_n, spec.ngram_min_n)


# ------------------------------------------------------------------ selection by config

@dataclass(frozen=True)
class DrafterSpec:
    """Which drafter a device drafts with and its parameters (``cloud.decode``).

    ``name``: a key of :data:`DRAFTERS`; ``draft_head``: the pruned head's size ``N``
    (``pruned_head``); ``shallow_layers``: the first ``L`` layers (``shallow``; at most the
    model's, checked when built); ``ngram_n`` / ``ngram_min_n``: the longest and shortest
    suffix prompt lookup matches (``ngram``). Raises ``ValueError`` for an unknown name or
    an out-of-range value.
    """
    name: str = "pruned_head"
    draft_head: int = 32768
    shallow_layers: int = 12
    ngram_n: int = 3
    ngram_min_n: int = 1

    def __post_init__(self):
        if self.name not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.name!r}: choose from {', '.join(DRAFTERS)}")
        if int(self.draft_head) < 1:
            raise ValueError(f"draft_head must be >= 1, got {self.draft_head} "
                             "(the drafter full_head drafts with the whole head)")
        for key in ("shallow_layers", "ngram_min_n"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.ngram_n < self.ngram_min_n:
            raise ValueError(f"need ngram_min_n <= ngram_n, got {self.ngram_min_n} > {self.ngram_n}")

    @property
    def head_size(self) -> int:
        """The pruned head size to build for this drafter (0: it needs none)."""
        return int(self.draft_head) if DRAFTERS[self.name].needs_head else 0


def drafter_factory(spec: DrafterSpec, head: DraftHead | None = None) -> Callable[[EdgeLM], Drafter]:
    """A function giving each simulated device its drafter over its :class:`EdgeLM`.

    Devices sharing a model share what can be shared: the pruned ``head`` (built by
    :func:`edgefuse.cloud.devices.pruned_head` for ``spec.head_size``), one shallow view,
    and (when the devices' :class:`EdgeLM` batch) one :class:`DraftBatcher` for it.

    Raises:
        ValueError: ``pruned_head`` without its head (raised when a drafter is built).
    """
    cls, shared = DRAFTERS[spec.name], {}
    return lambda edge: cls.build(spec, edge, head, shared)


def drafter_for(edge: EdgeLM) -> Drafter:
    """The default drafter of ``edge``: its pruned head (``edge.head``) if it has one, else
    its full head."""
    return FullHeadDrafter(edge) if edge.head is None else PrunedHeadDrafter(edge, edge.head)
