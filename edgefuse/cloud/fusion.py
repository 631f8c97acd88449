"""Logit fusion of the edge SLM with the cloud LLM (after Floe: "Floe: Federated Specialization
for Real-Time LLM-SLM Inference", which combines the two models' next-token distributions
with a fixed weight and leaves dynamic weighting as future work).

The cloud sends only its top-k log-probabilities and the log-mass of the rest (``TopK``); the
tail mass is spread evenly over the other V − k tokens, so the cloud's distribution is known
over the whole vocabulary without sending it. Fusion is a weighted geometric mixture (a
product of experts)::

    log p_fused(x) = w · log p_edge(x) + (1 − w) · log p_cloud(x) − log Z

with ``w`` the edge weight: fixed (``static``), or per token from the two models' confidence
(``adaptive``): ``w = σ((c_edge − c_cloud) / τ)`` where ``c`` is the negative entropy (nats)
or the top-1 − top-2 log-prob margin, so the more certain model gets the larger say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from edgefuse.cloud.protocol import ProtocolError, TopK

CONFIDENCES = ("entropy", "margin")


def cloud_logprobs(reply: TopK, vocab_size: int) -> torch.Tensor:
    """The cloud's log-probabilities over the full vocabulary, ``float64[vocab_size]``: the
    dequantized top-k where sent, ``tail − log(V − k)`` elsewhere.

    Raises :class:`~edgefuse.cloud.protocol.ProtocolError` (a ``ValueError``) for ids outside
    the vocabulary."""
    ids = torch.as_tensor(np.asarray(reply.ids, dtype=np.int64))
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ProtocolError(f"cloud top-k id outside the vocabulary of {vocab_size}")
    rest = max(vocab_size - len(ids), 1)
    out = torch.full((vocab_size,), reply.tail - math.log(rest), dtype=torch.float64)
    out[ids] = torch.as_tensor(reply.logprobs(), dtype=torch.float64)
    return out


def confidence(logp: torch.Tensor, kind: str) -> float:
    """Confidence of a distribution given as ``logp float[V]`` (nats): ``entropy`` → −H,
    ``margin`` → top-1 minus top-2 log-prob. Raises ``ValueError`` for another ``kind``."""
    if kind == "entropy":
        p = torch.exp(logp)
        return float((p * logp).nan_to_num(0.0).sum())
    if kind == "margin":
        top2 = torch.topk(logp, 2).values
        return float(top2[0] - top2[1])
    raise ValueError(f"unknown confidence {kind!r}; choose from {', '.join(CONFIDENCES)}")


@dataclass(frozen=True)
class FusionConfig:
    """``weight``: the edge weight w for ``static`` fusion (0 = cloud only, 1 = edge only);
    ``adaptive``: derive w per token from confidence (``entropy`` or ``margin``) with
    temperature ``tau`` (nats), clamped to [w_min, w_max]."""
    weight: float = 0.5
    adaptive: bool = False
    confidence: str = "entropy"
    tau: float = 1.0
    w_min: float = 0.05
    w_max: float = 0.95

    def __post_init__(self):
        if not 0 <= self.weight <= 1:
            raise ValueError(f"fusion weight must be in [0, 1], got {self.weight}")
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"unknown confidence {self.confidence!r}; choose from {', '.join(CONFIDENCES)}")
        if not self.tau > 0 or not 0 <= self.w_min <= self.w_max <= 1:
            raise ValueError("need tau > 0 and 0 <= w_min <= w_max <= 1")


def edge_weight(edge_logp: torch.Tensor, cloud_logp: torch.Tensor, cfg: FusionConfig) -> float:
    """The edge weight w for one token (see the module docstring)."""
    if not cfg.adaptive:
        return cfg.weight
    d = (confidence(edge_logp, cfg.confidence) - confidence(cloud_logp, cfg.confidence)) / cfg.tau
    w = 1.0 / (1.0 + math.exp(-max(min(d, 50.0), -50.0)))
    return min(max(w, cfg.w_min), cfg.w_max)


def fuse(edge_logits: torch.Tensor, reply: TopK, cfg: FusionConfig) -> tuple[torch.Tensor, float]:
    """Fused next-token log-probabilities ``float64[V]`` and the edge weight used.

    ``edge_logits``: the edge model's logits ``[V]`` (same vocabulary as the cloud)."""
    edge_logp = torch.log_softmax(edge_logits.double(), dim=-1)
    cloud_logp = cloud_logprobs(reply, edge_logp.shape[-1])
    w = edge_weight(edge_logp, cloud_logp, cfg)
    return torch.log_softmax(w * edge_logp + (1 - w) * cloud_logp, dim=-1), w
