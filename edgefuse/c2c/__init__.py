"""Cache-to-Cache (C2C) fusers for heterogeneous edge SLMs (plain PyTorch, no Flower).

A *receiver* model reads a *sharer* model's prefill KV cache, projected into the receiver's
KV space by a small learned fuser (Fu et al., 2025, arXiv 2510.03215; FedRefine):

- :mod:`edgefuse.c2c.layer_map` — which sharer layer each receiver layer fuses from;
- :mod:`edgefuse.c2c.align` — token alignment across tokenizers (and chat templates), and
  gathering the sharer's KV onto the receiver's tokens;
- :mod:`edgefuse.c2c.fuser` — the fuser modules (:class:`C2CFuser`), cache shapes
  (:class:`KVSpec`), and :func:`fused_forward` to run the receiver from a fused cache;
- :mod:`edgefuse.c2c.exchange` — the int8 wire codec of a prompt KV cache sent between devices;
- :mod:`edgefuse.c2c.multi` — several sharers into one receiver, weighted per layer by a gate.
"""

from .align import align_formatted, align_spans, align_tokens, gather_aligned
from .fuser import (
    C2CFuser,
    FuserConfig,
    KVSpec,
    LayerFuser,
    copy_cache,
    format_size_table,
    fused_forward,
    fuser_size,
    fuser_size_table,
    kv_spec_from_cache,
    kv_spec_from_config,
)
from .layer_map import layer_mapping
from .exchange import KVPayloadError, decode_kv_cache, encode_kv_cache
from .multi import MultiSharerGate, fuse_many

__all__ = [
    "C2CFuser", "FuserConfig", "KVSpec", "LayerFuser", "align_formatted", "align_spans",
    "align_tokens", "copy_cache", "format_size_table", "fused_forward", "fuser_size",
    "fuser_size_table", "gather_aligned", "kv_spec_from_cache", "kv_spec_from_config",
    "layer_mapping",
    "KVPayloadError", "decode_kv_cache", "encode_kv_cache",
    "MultiSharerGate", "fuse_many",
]
