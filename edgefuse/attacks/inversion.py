"""Inversion attacks of an honest-but-curious receiver on what a device sends.

The attacker knows the device's public base model (white box: its input embedding matrix
and architecture) and has public text to train on; it sees one payload per prompt and tries
to recover the prompt's tokens:

* ``kv`` — a shared KV cache (C2C sharer → receiver), per layer, after the int8 wire codec;
* ``hidden`` — hidden states after a layer, as split inference would send them;
* ``split_acts`` — what the cloud of a split session receives (:mod:`edgefuse.cloud.split`):
  the rows of the device's own front (after ``k`` layers) decoded from the exact bytes of the
  activation codec; ``split_head`` — with a split head, the tail columns of the final
  hidden state as HEAD carries them (:func:`split_features`);
* ``logits_topk`` — the top-k next-token distribution at every position;
* ``draft_tokens`` — the token ids the cloud sees (the prompt it prefills, drafted tokens):
  no learning needed, the ids *are* the text.

The learned attacker is a ridge regression from the payload's per-position features to the
input embedding of the token at that position, decoded by the nearest embedding (cosine)
over the full vocabulary — the linear probe of "Information Leakage from Embedding in Large
Language Models" (Wan et al., 2024) and of embedding-inversion baselines (Song & Raghunathan,
2020). Being linear it is a lower bound on what a stronger (learned decoder) attacker gets.

Scores compare the recovered ids with the *raw* prompt's ids, so a protection that changes
the text is credited only for what the attacker cannot get back:

* token accuracy = LCS(recovered, raw) / len(raw) — order-aware but shift-tolerant, so a
  rephrased prompt that keeps words in order still counts them as leaked (generous to the
  attacker; plain position-wise accuracy would be lower);
* exact match = the recovered text equals the raw prompt (whitespace-stripped).
"""

from __future__ import annotations

import numpy as np
import torch


def lcs_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)·len(b)))."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def token_accuracy(recovered: list[int], raw: list[int]) -> float:
    """``LCS(recovered, raw) / len(raw)`` in [0, 1]; 0 for an empty ``raw``."""
    return lcs_len(list(recovered), list(raw)) / len(raw) if len(raw) else 0.0


def unit_rows(embedding: torch.Tensor) -> torch.Tensor:
    """``embedding [V, d]`` with each row scaled to unit norm (float32): the cosine decoder."""
    e = embedding.detach().float()
    return e / e.norm(dim=-1, keepdim=True).clamp_min(1e-6)


class RidgeInverter:
    """Linear inversion: features ``[N, f]`` → input embedding ``[N, d]`` → nearest token.

    Args:
        embedding: the base model's input embedding matrix ``[V, d]`` (float).
        ridge: L2 penalty λ of the least-squares fit (features are standardized first).
        unit: :func:`unit_rows` of ``embedding`` when already computed (inverters of one
            model can share it: ``[V, d]`` float32 is 0.9 GB for a 1.5B model).
    """

    def __init__(self, embedding: torch.Tensor, ridge: float = 1.0, unit: torch.Tensor | None = None):
        e = embedding.detach().float()
        self.unit = unit_rows(e) if unit is None else unit
        self.embedding = e
        self.ridge = float(ridge)
        self.W: torch.Tensor | None = None

    def fit(self, X: torch.Tensor, ids: torch.Tensor) -> RidgeInverter:
        """Fit on features ``X [N, f]`` of positions whose tokens are ``ids [N]``.

        Raises:
            ValueError: shapes disagree or there are no rows."""
        X = X.float()
        if X.ndim != 2 or X.shape[0] != ids.shape[0] or X.shape[0] == 0:
            raise ValueError(f"features {tuple(X.shape)} and ids {tuple(ids.shape)} do not match")
        self.mu, self.sd = X.mean(0), X.std(0).clamp_min(1e-6)
        Z = torch.cat([(X - self.mu) / self.sd, torch.ones(X.shape[0], 1)], dim=1).double()
        Y = self.embedding[ids].double()
        A = Z.T @ Z + self.ridge * torch.eye(Z.shape[1], dtype=torch.float64)
        self.W = torch.linalg.solve(A, Z.T @ Y).float()
        return self

    @torch.no_grad()
    def predict(self, X: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """Recovered token ids ``[N]`` for features ``X [N, f]``.

        Raises:
            RuntimeError: called before :meth:`fit`."""
        if self.W is None:
            raise RuntimeError("fit the inverter before predicting")
        Z = torch.cat([(X.float() - self.mu) / self.sd, torch.ones(X.shape[0], 1)], dim=1)
        out = []
        for i in range(0, Z.shape[0], chunk):
            y = Z[i:i + chunk] @ self.W
            out.append(torch.argmax(y @ self.unit.T, dim=-1))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# ---------------------------------------------------------------------- payload features

def kv_features(cache, layers: list[int]) -> dict[int, torch.Tensor]:
    """Per layer, the keys and values of every position, heads flattened: ``{layer: [T,
    2·H_kv·D]}`` from a ``DynamicCache`` (batch 1) — what a KV-cache receiver holds."""
    out = {}
    for i in layers:
        layer = cache.layers[i]
        k, v = layer.keys[0], layer.values[0]  # [H, T, D]
        out[i] = torch.cat([k.permute(1, 0, 2).reshape(k.shape[1], -1),
                            v.permute(1, 0, 2).reshape(v.shape[1], -1)], dim=-1).float()
    return out


def hidden_features(hidden_states, layers: list[int]) -> dict[int, torch.Tensor]:
    """``{layer: [T, d]}``: the hidden state *after* decoder layer ``layer`` (index ``layer +
    1`` of ``output_hidden_states``), what split inference at that layer would send."""
    return {i: hidden_states[i + 1][0].float() for i in layers}


def wire_rows(x: torch.Tensor, act: str) -> tuple[bytes, torch.Tensor]:
    """Rows ``x [n, D]`` as the split link carries them: ``(buf, seen)``, ``buf`` the bytes
    :func:`edgefuse.cloud.split.encode_acts` produces and ``seen`` = ``decode_acts(buf)``
    (float32 ``[n, D]``), what the receiver holds: for ``int8`` within ``scale_r / 2`` of
    ``x`` per element. Raises ``ValueError`` as the codec does (unknown ``act``, NaN / inf)."""
    from edgefuse.cloud.split import decode_acts, encode_acts

    buf = encode_acts(x, act)
    return buf, decode_acts(buf, int(x.shape[0]), int(x.shape[1]), act)


@torch.no_grad()
def split_features(parts: dict, ids: list[int], act: str, head_split: int | None = None
                   ) -> tuple[dict[str, dict[int, bytes]], dict[str, dict[int, torch.Tensor]]]:
    """What the cloud of a split session receives of one prompt ``ids``, per split point.

    For each ``k`` of ``parts`` (``{k: SplitParts}`` from :func:`edgefuse.cloud.split.split_model`,
    all cut with the same ``m``) a fresh :class:`~edgefuse.cloud.split.DeviceSplit` runs its
    own ``front(ids)``; the rows go through the activation codec and the attacker's features
    are the decoded rows (the MID payload: ``[T, D]``). With ``head_split`` ``s``, the
    smallest ``k`` also runs the session to its HEAD: the middle (:func:`middle_forward`) on
    the decoded rows, MIDOUT through the codec, the device's back, ``head_part`` → the tail
    columns ``[T, D - s]`` of the final hidden state, through the codec (the HEAD payload).

    Returns:
        ``(payloads, features)``: ``{"split_acts": {k: bytes}, "split_head": {k: bytes}}``
        and the same shape of float32 features (``split_head`` empty without a split head).

    Raises:
        ValueError: no ids, a split that does not fit a part, a HEAD without a middle part."""
    from edgefuse.cloud.split import DeviceSplit, SplitSpec, middle_forward

    pay: dict[str, dict[int, bytes]] = {"split_acts": {}, "split_head": {}}
    feats: dict[str, dict[int, torch.Tensor]] = {"split_acts": {}, "split_head": {}}
    for k in sorted(parts):
        p = parts[k]
        dev = DeviceSplit(p, SplitSpec(p.k, p.m, head_split, act))
        buf, seen = wire_rows(dev.front(ids), act)
        pay["split_acts"][k], feats["split_acts"][k] = buf, seen
        if head_split is not None and k == min(parts):
            if p.middle is None:
                raise ValueError("split_features: a HEAD payload needs the middle part")
            (mid,), _ = middle_forward(p.middle, [None], [0], [seen])
            _, back_in = wire_rows(mid.float(), act)  # MIDOUT as the device decodes it
            _, tail = dev.head_part(dev.back(back_in))
            pay["split_head"][k], feats["split_head"][k] = wire_rows(tail.float(), act)
    return pay, feats


def topk_features(logits: torch.Tensor, k: int, embedding: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Top-``k`` next-token distribution per position and its features.

    Args:
        logits: ``[T, V]`` next-token logits at every position.
        k: entries kept per position (renormalised).
        embedding: ``[V, d]`` input embeddings.

    Returns:
        ``(features [T, 2d], ids int32 [T, k], probs float16 [T, k])``: the features
        (:func:`topk_from_payload`) are computed from the payload as sent (``ids``,
        ``probs``)."""
    p = torch.softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(p, k, dim=-1)
    vals = vals / vals.sum(-1, keepdim=True)
    ids, probs = ids.numpy().astype(np.int32), vals.numpy().astype(np.float16)
    return topk_from_payload(ids, probs, embedding), ids, probs


def topk_from_payload(ids: np.ndarray, probs: np.ndarray, embedding: torch.Tensor) -> torch.Tensor:
    """An attacker's summary of a top-k payload, ``[T, 2d]``: the probability-weighted mean
    embedding of the top-k (``probs`` renormalised) and the embedding of the top-1."""
    e = embedding.float()
    t_ids = torch.as_tensor(ids.astype(np.int64))
    p = torch.as_tensor(probs.astype(np.float32))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return torch.cat([torch.einsum("tk,tkd->td", p, e[t_ids]), e[t_ids[:, 0]]], dim=-1)
