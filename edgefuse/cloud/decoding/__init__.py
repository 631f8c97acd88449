"""Decoding with the cloud LLM on the device: the decoder loop (:mod:`.decoder`), its
drafters (:mod:`.drafters`), the edge model (:mod:`.edge`), settings (:mod:`.config`) and
results (:mod:`.result`); speculative decoding (Leviathan et al., 2023) and logit fusion
(Floe). The names other layers use are importable from here."""

from edgefuse.cloud.decoding.batcher import DraftBatcher
from edgefuse.cloud.decoding.config import (LINK_MODES, MODES, DecodeConfig, DecodeError,
                                            auth_from_config, check_config, decode_config,
                                            drafter_spec)
from edgefuse.cloud.decoding.decoder import Decoder
from edgefuse.cloud.decoding.drafters import (DRAFTERS, Draft, Drafter, DrafterSpec, DraftHead,
                                              FullHeadDrafter, NgramDrafter, PrunedHeadDrafter,
                                              ShallowDrafter, drafter_factory, drafter_for)
from edgefuse.cloud.decoding.edge import EdgeLM, OnnxEdgeLM
from edgefuse.cloud.decoding.result import DecodeResult

__all__ = ["DRAFTERS", "LINK_MODES", "MODES", "DecodeConfig", "DecodeError", "DecodeResult",
           "Decoder", "Draft", "DraftBatcher", "DraftHead", "Drafter", "DrafterSpec", "EdgeLM",
           "FullHeadDrafter", "NgramDrafter", "OnnxEdgeLM", "PrunedHeadDrafter", "ShallowDrafter",
           "auth_from_config", "check_config", "decode_config", "drafter_factory", "drafter_for",
           "drafter_spec"]
