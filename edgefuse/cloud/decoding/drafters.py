"""Cheap drafts for speculative decoding on the device: a frequency-pruned LM head, a
shallow (first-L-layers) view of the draft model, and prompt-lookup n-gram drafting.

Why: on a CPU core the draft's per-token cost is memory bound (every weight is read once
per token), and Qwen2.5's 151,936 x 896 LM head is 136 M of the ~494 M weights the 0.5B
draft reads per token (fp32: 0.54 GB of ~2 GB; the input embedding reads one row). On one
core that is ~29 of ~110 ms per token; the 24 decoder layers are the rest. Three ways to
draft for less, measured by ``bench/bench_draft.py``:

* **Frequency-ranked head** (FR-Spec: Zhao et al., "FR-Spec: Accelerating Large-Vocabulary
  Language Models via Frequency-Ranked Speculative Sampling", ACL 2025, arXiv:2502.14856):
  the draft scores only the ``N`` most frequent tokens of a public corpus, so its head is
  ``N x H`` instead of ``V x H``. :func:`frequent_token_ids` picks the ids,
  :class:`DraftHead` applies the pruned head.
* **Shallow draft** (early exit without training): the first ``L`` decoder layers, the
  final norm and the head; :func:`shallow_model` builds it sharing the weights.
* **Prompt lookup** (Saxena, "Prompt Lookup Decoding", 2023,
  github.com/apoorvumang/prompt-lookup-decoding): :class:`NgramDrafter` proposes the
  tokens that followed the most recent earlier occurrence of the context's last n tokens.
  No model at all; it pays off where outputs copy from the prompt.

None of them can change what speculative decoding outputs. Greedy verification keeps a
drafted token only when it equals the target's own argmax, and speculative sampling
(Leviathan et al. 2023) accepts/resamples against the target distribution p for *any*
draft distribution q: the committed tokens are distributed exactly as the target's. A
draft restricted to a vocabulary subset is such a q (zero mass outside the subset; a
token it never proposes still comes out of the residual max(p - q, 0)). So a cheaper
draft only changes how many tokens each round trip commits (the acceptance rate), never
the text.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

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

    @torch.no_grad()
    def propose(self, model, input_ids: torch.Tensor, cache, gamma: int):
        """Greedy draft of ``gamma`` tokens: feed ``input_ids`` ``[1, T]``, then each
        drafted token; the cache ends holding ``input_ids`` and all drafts but the last
        (crop it to the accepted length after verification).

        Returns:
            ``(drafted vocabulary ids: list[int] of length gamma, cache)``.
        """
        out, x = [], input_ids
        for _ in range(gamma):
            logits, cache = self.forward_last(model, x, cache)
            tok = int(self.to_vocab(logits[0].argmax()))
            out.append(tok)
            x = torch.tensor([[tok]], dtype=torch.long, device=input_ids.device)
        return out, cache


# ------------------------------------------------------------------ shallow draft

def shallow_model(model, num_layers: int):
    """A view of ``model`` that runs only its first ``num_layers`` decoder layers, then the
    final norm and the LM head (early exit, no training). Shares every weight: no copy.

    The returned object is a shallow copy of the causal LM with its own config
    (``num_hidden_layers = num_layers``, ``layer_types`` cut to match) and a body whose
    layer list holds the first ``num_layers`` layer modules; ``shallow(input_ids)`` and
    :meth:`DraftHead.forward_last` work on it as on the full model, with a KV cache of
    ``num_layers`` layers. Its layer-``i`` cache equals the full model's.

    Raises:
        ValueError: ``num_layers`` not in ``[1, num_hidden_layers]``, or a model with no
            ``model.layers`` decoder stack.
    """
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


# ------------------------------------------------------------------ prompt lookup

class NgramDrafter:
    """Prompt-lookup decoding (Saxena 2023): draft by copying from the context.

    For ``n`` from ``max_n`` down to ``min_n``: find the most recent earlier occurrence of
    the last ``n`` tokens in ``tokens`` (prompt + generated so far) and propose up to
    ``gamma`` tokens that followed it. Costs a few microseconds per call and no model.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: Sequence[int], gamma: int) -> list[int]:
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
