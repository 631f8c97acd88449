"""Several sharers into one receiver: a small gate weights or drops each sharer per layer.

Each ordered pair (receiver ← sharer ``k``) has its own trained :class:`edgefuse.c2c.fuser.C2CFuser`,
which turns the receiver's prompt cache ``R`` into a fused cache ``F_k`` (same shapes as
``R``). :func:`fuse_many` combines them per receiver layer ``i``, for keys and values alike::

    out_i = Σ_k w[b, i, k] · F_k,i  +  (1 - Σ_k w[b, i, k]) · R_i
          = R_i + Σ_k w[b, i, k] · (F_k,i - R_i)

Written in the first form, one-hot weights give ``F_k`` bit for bit and zero weights give
``R``. The weights ``w ∈ [0, 1]`` come from :class:`MultiSharerGate`, which reads only the
receiver's own prompt cache (so it runs before any sharer cache arrives), or are ``1/K``
without a gate (the plain average of the fused caches).

Training (:func:`edgefuse.c2c.gate_train.train_gate`, in its own module so the query-time path
never imports training code) follows :mod:`edgefuse.c2c.train`: the receiver prefills all but
its last prompt token, every fuser (frozen, eval mode: hard gates) fuses its sharer's cache
into that prefill, the gate combines them, and the loss is the receiver's response CE from
the continuation ``[last prompt token] + response``. Only the gate learns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from .fuser import KVSpec, copy_cache

_MAX_INIT_WEIGHT = 0.95  # initial weight of a lone sharer (sigmoid cannot start at 1)


class MultiSharerGate(nn.Module):
    """Per receiver layer, one weight in ``[0, 1]`` per sharer, from the receiver's cache.

    Layer ``i`` has ``Linear(2·Hr·Dr -> K)``; its input is the receiver layer's keys and
    values averaged over the cached tokens, heads flattened (``[B, 2·Hr·Dr]``), then
    layer-normalised without parameters (key scales differ widely between models). The
    weight is ``sigmoid`` of the output. The linear weights start at zero and the biases at
    ``logit(1/K)``, so an untrained gate gives every sharer ``1/K`` everywhere: the plain
    average, as :func:`fuse_many` without a gate (a lone sharer, ``K = 1``, starts at
    ``0.95``). In eval mode a weight below ``drop_threshold`` becomes exactly 0 (the
    sharer is dropped for that layer and batch row); in training mode weights stay soft.

    Args:
        spec: the receiver's cache shape (:class:`edgefuse.c2c.fuser.KVSpec`).
        num_sharers: ``K >= 1``.
        drop_threshold: in ``[0, 1)``.

    Raises:
        ValueError: ``num_sharers < 1`` or ``drop_threshold`` outside ``[0, 1)``.
    """

    def __init__(self, spec: KVSpec, num_sharers: int, drop_threshold: float = 0.1):
        super().__init__()
        if num_sharers < 1:
            raise ValueError(f"num_sharers must be >= 1, got {num_sharers}")
        if not 0.0 <= drop_threshold < 1.0:
            raise ValueError(f"drop_threshold must be in [0, 1), got {drop_threshold}")
        self.spec, self.num_sharers, self.drop_threshold = spec, num_sharers, drop_threshold
        p0 = min(1.0 / num_sharers, _MAX_INIT_WEIGHT)
        self.layers = nn.ModuleList()
        for i in range(spec.num_layers):
            lin = nn.Linear(2 * spec.width(i), num_sharers)
            nn.init.zeros_(lin.weight)
            nn.init.constant_(lin.bias, math.log(p0 / (1.0 - p0)))
            self.layers.append(lin)

    def num_parameters(self) -> int:
        """Parameter count: ``Σ_i (2·Hr_i·Dr_i + 1)·K``."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, receiver_cache: DynamicCache) -> torch.Tensor:
        """Weights ``[B, num_layers, K]`` in ``[0, 1]`` (dropped ones exactly 0 in eval mode).

        Raises:
            ValueError: the cache's layer count, heads or head_dim differ from ``spec``,
                a layer is empty, or layers disagree on the batch size.
        """
        layers = list(receiver_cache.layers)
        if len(layers) != self.spec.num_layers:
            raise ValueError(f"the receiver cache has {len(layers)} layers, the gate expects {self.spec.num_layers}")
        out, dtype = [], self.layers[0].weight.dtype
        for i, (layer, lin) in enumerate(zip(layers, self.layers)):
            keys, values = layer.keys, layer.values
            if keys is None or keys.numel() == 0:
                raise ValueError(f"receiver cache layer {i} is empty: prefill the prompt first")
            want = (self.spec.kv_heads[i], self.spec.head_dim[i])
            if (keys.shape[1], keys.shape[3]) != want or values.shape != keys.shape:
                raise ValueError(f"receiver cache layer {i} has keys {tuple(keys.shape)} / values "
                                 f"{tuple(values.shape)}, the gate expects {want[0]} heads of dim {want[1]}")
            x = torch.cat([keys.mean(dim=2).flatten(1), values.mean(dim=2).flatten(1)], dim=-1).to(dtype)
            x = F.layer_norm(x, x.shape[-1:])
            out.append(torch.sigmoid(lin(x)))
        if len({w.shape[0] for w in out}) != 1:
            raise ValueError("receiver cache layers disagree on the batch size")
        weights = torch.stack(out, dim=1)
        if not self.training:
            weights = torch.where(weights < self.drop_threshold, torch.zeros_like(weights), weights)
        return weights


def fuse_many(receiver_cache: DynamicCache, fused_caches: list[DynamicCache],
              gate: MultiSharerGate | None = None) -> DynamicCache:
    """Combine the per-sharer fused caches into one receiver cache (module docstring).

    Args:
        receiver_cache: the receiver's prompt cache ``R``; keys/values ``[B, Hr, T_i, Dr]``.
        fused_caches: ``K`` caches ``F_k`` shaped exactly like ``R`` (each a
            :class:`edgefuse.c2c.fuser.C2CFuser` output for one sharer).
        gate: per-layer weights from ``R``; ``None``: ``1/K`` each (the average).

    Returns:
        A new cache (same layer types and lengths as ``R``, via :func:`copy_cache`); no
        input is modified. Differentiable with respect to the gate's parameters (and to
        the fused caches).

    Raises:
        ValueError: an empty list; a gate for another number of sharers; a fused cache
            with another layer count, or a layer whose keys or values differ in shape
            from the receiver's; the gate's own checks (:meth:`MultiSharerGate.forward`).
    """
    if not fused_caches:
        raise ValueError("no fused caches to combine")
    k = len(fused_caches)
    r_layers = list(receiver_cache.layers)
    for n, cache in enumerate(fused_caches):
        layers = list(cache.layers)
        if len(layers) != len(r_layers):
            raise ValueError(f"fused cache {n} has {len(layers)} layers, the receiver's has {len(r_layers)}")
        for i, (f, r) in enumerate(zip(layers, r_layers)):
            if r.keys is None or f.keys is None or f.keys.shape != r.keys.shape \
                    or f.values.shape != r.values.shape:
                got = None if f.keys is None else tuple(f.keys.shape)
                want = None if r.keys is None else tuple(r.keys.shape)
                raise ValueError(f"fused cache {n} layer {i} has keys {got}, the receiver's {want}")
    if gate is not None:
        if gate.num_sharers != k:
            raise ValueError(f"the gate weighs {gate.num_sharers} sharers, got {k} fused caches")
        weights = gate(receiver_cache)  # [B, L, K]
    else:
        b = r_layers[0].keys.shape[0]
        weights = torch.full((b, len(r_layers), k), 1.0 / k, device=r_layers[0].keys.device)
    out = copy_cache(receiver_cache)
    for i, layer in enumerate(out.layers):
        w = weights[:, i, :].to(layer.keys.dtype)  # [B, K]
        rest = (1 - w.sum(dim=1)).view(-1, 1, 1, 1)
        for name in ("keys", "values"):
            acc = rest * getattr(layer, name)
            for n, cache in enumerate(fused_caches):
                acc = acc + w[:, n].view(-1, 1, 1, 1) * getattr(cache.layers[i], name)
            setattr(layer, name, acc)
    return out
