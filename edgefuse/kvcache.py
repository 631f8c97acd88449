"""KV-cache helpers every layer uses: a cheap copy of a cache, and a forward pass that
continues after one (transformers 5's ``cache=`` / ``DynamicCache``)."""

from __future__ import annotations

from copy import copy as _shallow_copy

import torch
from transformers import DynamicCache


def copy_cache(cache: DynamicCache) -> DynamicCache:
    """A new ``DynamicCache`` whose layers are shallow copies of ``cache``'s.

    Tensors are shared, not copied; a forward pass on the copy appends to (rebinds) its own
    layers only, so the original cache is never changed.
    """
    new = DynamicCache()
    new.layers = [_shallow_copy(layer) for layer in cache.layers]
    return new


def fused_forward(receiver_model, fused_cache: DynamicCache, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, copy: bool = True) -> torch.Tensor:
    """Run the receiver on continuation tokens after a (fused) prompt cache; return logits.

    Positions continue after the prompt: ``position_ids = Tr + arange(T)``. With
    ``copy=True`` (default) the forward pass appends to a shallow copy, so ``fused_cache``
    stays the prompt cache and can be reused (several continuations, training steps);
    with ``copy=False`` it grows in place (decoding). Gradients flow into the fused cache
    (hence into the fuser) unless the caller disables them.

    Args:
        receiver_model: a transformers causal LM (frozen or not).
        fused_cache: the receiver-shaped prompt cache (e.g. from :class:`C2CFuser`).
        input_ids: ``[B, T]`` continuation tokens.
        attention_mask: optional ``[B, Tr + T]`` mask over prompt and continuation.

    Returns:
        Logits ``[B, T, vocab]``.
    """
    cache = copy_cache(fused_cache) if copy else fused_cache
    past = cache.get_seq_length()
    position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
    out = receiver_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True)
    return out.logits


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding ``[(keys, values)]`` per layer (tensors shared, not copied)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def cache_layers(out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(keys, values)`` of every layer of a forward output's cache."""
    return [(layer.keys, layer.values) for layer in out.cache.layers]
