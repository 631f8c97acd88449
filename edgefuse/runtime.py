"""Device runtimes: which engine runs a device's language model, and the ONNX Runtime one.

A device picks a *profile* (``device.profile`` in its federation entry, or ``device-profile``
in its own ``node_config``, which wins: the device knows its hardware):

- ``cpu`` (default): PyTorch, float32, on the CPU.
- ``gpu``: PyTorch on CUDA in float16 when torch sees a GPU; otherwise it falls back to
  ``cpu`` with a warning (``device.fallback: false`` refuses instead).
- ``edge``: the model exported to ONNX (:mod:`edgefuse.export`, quantized ``device.quant``:
  ``fp32``, ``int8`` or ``int4`` weights) and run by ONNX Runtime on the CPU
  (:class:`OnnxDecoder`). Training (LoRA) stays in PyTorch; the current adapter is merged
  before export.

The decoding loop sees one interface whatever the profile
(:class:`edgefuse.cloud.decoding.edge.EdgeLM` and its ONNX twin ``OnnxEdgeLM``): prefill,
step over a KV cache, next-token logits, rollback to a length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PROFILES = ("cpu", "gpu", "edge")
QUANTS = ("fp32", "int8", "int4")
NODE_PROFILE, NODE_QUANT, NODE_FALLBACK = "device-profile", "device-quant", "device-fallback"  # node_config
NODE_KEYS = (NODE_PROFILE, NODE_QUANT, NODE_FALLBACK, "device-dir")  # the device-* keys a node may set
EXPORT_META = "edgefuse-export.json"  # what edgefuse.export writes beside the model


class ProfileError(ValueError):
    """A device profile that is unknown, malformed, or that this machine cannot run."""


@dataclass(frozen=True)
class DeviceProfile:
    """How a device runs its model: ``profile`` (:data:`PROFILES`), ``quant`` (:data:`QUANTS`,
    the ``edge`` profile's weights) and ``fallback`` (``gpu`` without CUDA runs on the CPU
    rather than failing)."""

    profile: str = "cpu"
    quant: str = "int8"
    fallback: bool = True

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ProfileError(f"unknown device profile {self.profile!r}: choose from {', '.join(PROFILES)}")
        if self.quant not in QUANTS:
            raise ProfileError(f"unknown quantization {self.quant!r}: choose from {', '.join(QUANTS)}")

    @classmethod
    def of(cls, entry=None, node_config: Mapping | None = None) -> "DeviceProfile":
        """The profile of one device: its federation entry's ``device`` mapping
        (``{profile, quant, fallback}``), overridden by its own ``node_config`` keys
        ``device-profile`` / ``device-quant`` / ``device-fallback``.

        Raises:
            ProfileError: an unknown profile, quantization or key (another ``device-*`` key in
                the node config included: a misspelt key would silently do nothing), or a
                ``device`` entry that is not a mapping.
        """
        conf = {}
        raw = entry.get("device", None) if entry is not None and hasattr(entry, "get") else None
        if raw is not None:
            if not hasattr(raw, "items"):
                raise ProfileError(f"a client's device entry must be a mapping like "
                                   f"{{profile: edge, quant: int8}}, got {raw!r}")
            conf = {str(k): v for k, v in raw.items()}
            unknown = set(conf) - {"profile", "quant", "fallback"}
            if unknown:
                raise ProfileError(f"unknown device key(s) {sorted(unknown)}: use profile, quant, fallback")
        node = node_config or {}
        odd = sorted(k for k in node if str(k).startswith("device-") and k not in NODE_KEYS)
        if odd:
            raise ProfileError(f"unknown node config key(s) {odd}: use {', '.join(NODE_KEYS)}")
        if NODE_PROFILE in node:
            conf["profile"] = node[NODE_PROFILE]
        if NODE_QUANT in node:
            conf["quant"] = node[NODE_QUANT]
        if NODE_FALLBACK in node:  # flwr parses true/false; a string stays a string
            raw_fb = node[NODE_FALLBACK]
            conf["fallback"] = {"true": True, "false": False}.get(str(raw_fb).lower(), raw_fb)
        fallback = conf.get("fallback", True)
        if not isinstance(fallback, bool):
            raise ProfileError(f"device.fallback must be true or false, got {fallback!r}")
        return cls(str(conf.get("profile", "cpu")), str(conf.get("quant", "int8")), fallback)

    def check(self, cuda_available: bool | None = None) -> "DeviceProfile":
        """Raise :class:`ProfileError` when this machine cannot run the profile (``gpu`` without
        CUDA and without fallback, ``edge`` without ONNX Runtime); a device checks this at its
        first message, before any round. Returns ``self``."""
        if self.profile == "edge":
            check_edge()
        elif self.profile == "gpu" and not self.fallback:
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
            if not cuda_available:
                self.torch_device(cuda_available=False)  # raises
        return self

    def torch_device(self, cuda_available: bool | None = None) -> str:
        """The torch device the ``cpu`` / ``gpu`` profiles run on (``edge`` runs ONNX Runtime on
        the CPU; its PyTorch side, e.g. training, stays on the CPU).

        Raises:
            ProfileError: ``gpu`` on a machine without CUDA and ``fallback`` off.
        """
        if self.profile != "gpu":
            return "cpu"
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if cuda_available:
            return "cuda"
        if not self.fallback:
            raise ProfileError("device profile gpu: torch sees no CUDA device on this machine "
                               "(set device.fallback: true to run on the CPU instead)")
        log.warning("device profile gpu: no CUDA device here; decoding runs on the CPU (profile cpu)")
        return "cpu"


def check_edge() -> None:
    """Raise :class:`ProfileError` (one line) when this machine cannot run the ``edge`` profile:
    ONNX Runtime (and, to export, onnxruntime-genai's model builder) not importable."""
    for module, package in (("onnxruntime", "onnxruntime"), ("onnxruntime_genai.models.builder",
                                                             "onnxruntime-genai")):
        try:
            __import__(module)
        except ImportError as exc:
            raise ProfileError(f"device profile edge needs {package} (pip install {package}): "
                               f"{exc}") from None


class OnnxDecoder:
    """A decoder exported by :func:`edgefuse.export.export_onnx`, run by ONNX Runtime on the CPU.

    The graph takes ``input_ids [1, S]``, ``attention_mask [1, P+S]`` and per layer the past
    keys / values ``float32 [1, kv_heads, P, head_size]``, and returns ``logits [1, S, V]``
    and the present keys / values ``[1, kv_heads, P+S, head_size]``. The KV cache lives in the
    caller's hands (a list of numpy arrays), so a rollback is a slice (:meth:`crop`). One
    decoder serves any number of threads (ONNX Runtime sessions run concurrently); each
    caller keeps its own cache.

    Args:
        folder: the export folder (``model.onnx``, its ``.data``, ``genai_config.json``).
        threads: ONNX Runtime intra-op threads.

    Raises:
        ProfileError: ONNX Runtime missing, or the folder is not an export.
    """

    def __init__(self, folder: str | Path, threads: int = 1):
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ProfileError(f"device profile edge needs onnxruntime: {exc}") from None
        self.folder = Path(folder)
        redo = "re-export it (edgefuse models export NAME --quant Q --force)"
        try:
            meta = json.loads((self.folder / "genai_config.json").read_text())["model"]
            dec = meta["decoder"]
            self.kv_heads, self.head_size = int(dec["num_key_value_heads"]), int(dec["head_size"])
            self.num_layers, self.vocab_size = int(dec["num_hidden_layers"]), int(meta["vocab_size"])
            self.context_length = int(meta.get("context_length", 2 ** 31 - 1))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"{self.folder}: not an ONNX export ({type(exc).__name__}: {exc}); {redo}") from None
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(int(threads), 1)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(self.folder / "model.onnx"), opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # ONNX Runtime's own error types: a truncated or corrupt file
            first = (str(exc).splitlines() or [""])[0][:160]
            raise ProfileError(f"{self.folder}: ONNX Runtime cannot load this export ({first}); {redo}") from None
        names = [i.name for i in self.session.get_inputs()]
        self.past_names = [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        missing = [n for n in ["input_ids", "attention_mask", *self.past_names] if n not in names]
        if missing:
            raise ProfileError(f"{self.folder}: the graph lacks input(s) {missing[:3]}")
        self.position_ids = "position_ids" in names
        self.outputs = ["logits"] + [n.replace("past_key_values", "present") for n in self.past_names]
        meta_path = self.folder / EXPORT_META
        self.meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}

    def empty(self) -> list[np.ndarray]:
        """An empty KV cache: ``2 * num_layers`` arrays ``float32 [1, kv_heads, 0, head_size]``."""
        return [np.zeros((1, self.kv_heads, 0, self.head_size), np.float32) for _ in self.past_names]

    @staticmethod
    def length(past: Sequence[np.ndarray]) -> int:
        """Positions held by a KV cache."""
        return int(past[0].shape[2])

    @staticmethod
    def crop(past: Sequence[np.ndarray], n: int) -> list[np.ndarray]:
        """The first ``n`` positions of a KV cache (views; nothing is copied)."""
        return [p[:, :, :n] for p in past]

    def forward(self, ids: Sequence[int], past: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Run ``ids`` (``S >= 1`` token ids) after the ``P`` positions of ``past``.

        Returns:
            ``(logits float32 [S, V], present)``: next-token logits after each of ``ids``, and
            the KV cache of all ``P + S`` positions.

        Raises:
            ValueError: no ids, ids that are not integers or lie outside ``[0, V)``, a cache of
                the wrong layout (count, shape, dtype), or more positions than the export's
                ``context_length``.
        """
        ids = np.asarray(list(ids))
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("forward needs at least one token id")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")
        if len(past) != len(self.past_names):
            raise ValueError(f"a KV cache of {len(past)} arrays, the graph takes {len(self.past_names)}")
        start = self.length(past)
        for p in past:
            if getattr(p, "dtype", None) != np.float32 or p.shape != (1, self.kv_heads, start, self.head_size):
                raise ValueError(f"a KV cache array of {getattr(p, 'dtype', type(p))} "
                                 f"{getattr(p, 'shape', '?')}, the graph takes float32 "
                                 f"(1, {self.kv_heads}, {start}, {self.head_size})")
        total = start + int(ids.size)
        if total > self.context_length:
            raise ValueError(f"{total} positions exceed the export's context length {self.context_length}")
        feed = {"input_ids": ids[None], "attention_mask": np.ones((1, total), np.int64)}
        if self.position_ids:
            feed["position_ids"] = np.arange(start, total, dtype=np.int64)[None]
        feed.update(zip(self.past_names, past))
        out = self.session.run(self.outputs, feed)
        return out[0][0], out[1:]
