"""Cache-to-Cache (C2C) fusers: project a sharer's KV cache into a receiver's KV space.

C2C (Fu et al., 2025, arXiv 2510.03215) lets a *receiver* model read what a *sharer* model
computed for the same prompt: the sharer prefills its own tokenization of the prompt, and a
small learned *fuser* adds a projection of the sharer's keys and values to the receiver's
own prompt cache, layer by layer. The receiver then decodes from the fused cache with its
unmodified weights (the models' public cache API only; no attention patching).

Per receiver layer ``i`` that has a sharer layer ``j`` (:mod:`edgefuse.c2c.layer_map`), and
separately for keys and values, with the sharer's tokens gathered onto the receiver's
token axis (:mod:`edgefuse.c2c.align`)::

    x      = concat(receiver_kv[i] (heads flattened, Hr*Dr), sharer_kv[j] (Hs*Ds))  per token
    h      = SiLU(Linear(Hr*Dr + Hs*Ds -> b)(x))          low-rank bottleneck
    proj   = Linear(b -> Hr*Dr)(h)                         zero-initialised
    weight = sigmoid(Linear(b -> Hr)(h))                   per head, per token
    gate   = Gumbel-sigmoid(logit, tau) when training; [logit > 0] at inference
    out    = receiver_kv[i] + gate * weight * proj         only where the token mask is True

Because ``proj`` starts at zero, an untrained fuser returns the receiver's cache unchanged,
and a hard gate that is off returns it bit for bit.

Assumptions:

- **Post-RoPE caches.** Transformers caches keys after the rotary embedding, with each
  model's own positions and rope base (Gemma 3 even uses different bases for its sliding
  and full layers). The fuser works on these cached tensors as C2C does: it is per layer,
  so it learns each receiver layer's rotation convention, and its input contains the
  receiver's own key (already rotated at the receiver's position). It cannot re-rotate
  exactly; that is the learned part. Positions of the continuation simply follow the
  receiver's prompt length (see :func:`fused_forward`).
- **Sliding-window layers** (Gemma 3). A ``DynamicSlidingWindowLayer`` keeps only the last
  ``sliding_window - 1`` tokens of the prompt. Layers are aligned by position *from the
  end*: the receiver layer's ``L`` cached slots are prompt tokens ``Tr - L .. Tr - 1``, the
  sharer layer's are ``Ts - Ls .. Ts - 1``. Only those receiver slots are fused, and each
  reads only the sharer tokens of its alignment that are still in the sharer layer's
  window; a slot whose sharer tokens all fell out of the window is left as is.
- **One token alignment per batch** (see :mod:`edgefuse.c2c.align`); the token mask may differ
  per batch row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from edgefuse.c2c.align import REDUCTIONS, gather_aligned
from edgefuse.c2c.layer_map import STRATEGIES, layer_mapping
from edgefuse.kvcache import copy_cache, fused_forward  # noqa: F401  (part of this module's API)


SHARER_CONTROLS = ("none", "zero", "shuffled")


@dataclass
class FuserConfig:
    """Hyper-parameters of a :class:`C2CFuser` (the weights live elsewhere).

    Attributes:
        bottleneck: width ``b`` of the low-rank MLP.
        layer_mapping: receiver→sharer layer strategy (:func:`edgefuse.c2c.layer_map.layer_mapping`).
        reduction: how several sharer tokens on one receiver token combine
            (``first`` / ``last`` / ``mean``).
        gate_init: initial gate logit of every K and V gate (0 = undecided).
        init_temperature: Gumbel-sigmoid temperature at the start of training.
        min_temperature: temperature at the end of the annealing schedule.
        input_norm: RMS-normalise the receiver's and the sharer's per-token features
            (separately, no parameters) before the bottleneck. Post-RoPE keys differ in
            scale by orders of magnitude across models (Qwen2.5's key bias gives outliers in
            the hundreds); the output still lives in the receiver's raw scale (``up``).
            Off by default: on SmolLM2 ← Qwen2.5-0.5B (60 steps) it made no measurable
            difference (bench/bench_fuser_pair.py; held-out 2.951 without it in
            bench/results/bench_fuser_pair.json, the run with it kept no JSON).
        sharer_control: what the fuser is fed in place of the sharer's own cache
            (:data:`SHARER_CONTROLS`, :func:`control_sharer`): ``none`` (the real sharer), ``zero``
            (an all-zero cache: any gain is the fuser's own capacity, a learned prefix) or
            ``shuffled`` (another prompt's sharer cache: real sharer statistics without this
            prompt's information). A control fuser is trained and served like a real one;
            the setting is part of its config hash, so it is its own registry version.
    """

    bottleneck: int = 64
    layer_mapping: str = "last_aligned"
    reduction: str = "mean"
    gate_init: float = 0.0
    init_temperature: float = 1.0
    min_temperature: float = 0.1
    input_norm: bool = False
    sharer_control: str = "none"

    def __post_init__(self):
        if self.bottleneck < 1:
            raise ValueError(f"bottleneck must be >= 1, got {self.bottleneck}")
        if self.layer_mapping not in STRATEGIES:
            raise ValueError(f"unknown layer_mapping {self.layer_mapping!r}: use one of {', '.join(STRATEGIES)}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}: use one of {', '.join(REDUCTIONS)}")
        if self.sharer_control not in SHARER_CONTROLS:
            raise ValueError(f"unknown sharer_control {self.sharer_control!r}: use one of "
                             f"{', '.join(SHARER_CONTROLS)}")
        if not 0 < self.min_temperature <= self.init_temperature:
            raise ValueError("temperatures must satisfy 0 < min_temperature <= init_temperature, got "
                             f"min={self.min_temperature}, init={self.init_temperature}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FuserConfig:
        """Build from a dict (e.g. JSON); unknown keys are an error, missing ones default."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown FuserConfig keys {sorted(unknown)}: valid keys are {sorted(known)}")
        return cls(**d)


@dataclass
class KVSpec:
    """The shape of one model's KV cache, per layer.

    Attributes:
        num_layers: decoder layers (one cache layer each).
        kv_heads: key/value heads of each layer.
        head_dim: head dimension of each layer.
        sliding: whether each layer is a sliding-window layer (default: none).
        sliding_window: the window of the sliding layers (``None`` when there are none).
    """

    num_layers: int
    kv_heads: list[int]
    head_dim: list[int]
    sliding: list[bool] = field(default_factory=list)
    sliding_window: int | None = None

    def __post_init__(self):
        self.kv_heads, self.head_dim = list(self.kv_heads), list(self.head_dim)
        self.sliding = list(self.sliding) or [False] * self.num_layers
        for name in ("kv_heads", "head_dim", "sliding"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"KVSpec.{name} has {len(getattr(self, name))} entries for "
                                 f"{self.num_layers} layers")

    @classmethod
    def uniform(cls, num_layers: int, kv_heads: int, head_dim: int) -> KVSpec:
        """All layers alike, no sliding window (e.g. a real model's published shape)."""
        return cls(num_layers, [kv_heads] * num_layers, [head_dim] * num_layers)

    def width(self, layer: int) -> int:
        """``kv_heads * head_dim`` of ``layer``: the flattened size of one token's K or V."""
        return self.kv_heads[layer] * self.head_dim[layer]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVSpec:
        return cls(**d)


def kv_spec_from_config(config) -> KVSpec:
    """The :class:`KVSpec` of a transformers model config (llama, qwen2, gemma3_text, ...).

    Uses ``config.head_dim`` when set, else ``hidden_size // num_attention_heads``;
    ``num_key_value_heads`` (default: ``num_attention_heads``); and ``config.layer_types``
    (``sliding_attention`` / ``full_attention``) when present.

    Raises:
        ValueError: a layer type other than full or sliding attention.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"unsupported layer types {bad} in {config.model_type}: only full and sliding attention")
    sliding = [t == "sliding_attention" for t in types]
    window = getattr(config, "sliding_window", None) if any(sliding) else None
    return KVSpec(n, [kv] * n, [hd] * n, sliding, window)


def kv_spec_from_cache(cache: DynamicCache) -> KVSpec:
    """The :class:`KVSpec` of a filled cache (the sliding window read from its layers)."""
    layers = list(cache.layers)
    if not layers or any(layer.keys is None for layer in layers):
        raise ValueError("the cache is empty: prefill it before reading its shape")
    sliding = [bool(getattr(layer, "is_sliding", False)) for layer in layers]
    windows = {layer.sliding_window for layer, s in zip(layers, sliding) if s}
    return KVSpec(len(layers), [layer.keys.shape[1] for layer in layers],
                  [layer.keys.shape[3] for layer in layers], sliding,
                  windows.pop() if len(windows) == 1 else None)


class _Branch(nn.Module):
    """The fuser of one receiver layer for keys *or* values."""

    def __init__(self, r_heads: int, r_dim: int, s_width: int, bottleneck: int, gate_init: float,
                 input_norm: bool = False):
        super().__init__()
        self.r_heads, self.r_dim, self.input_norm = r_heads, r_dim, input_norm
        self.down = nn.Linear(r_heads * r_dim + s_width, bottleneck)
        self.up = nn.Linear(bottleneck, r_heads * r_dim)
        self.head = nn.Linear(bottleneck, r_heads)
        self.gate_logit = nn.Parameter(torch.tensor(float(gate_init)))
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def gate(self, temperature: float) -> torch.Tensor:
        """Relaxed-Bernoulli (Gumbel-sigmoid) sample when training, the hard gate otherwise."""
        if not self.training:
            return (self.gate_logit > 0).to(self.gate_logit.dtype)
        u = torch.rand((), device=self.gate_logit.device).clamp(1e-6, 1 - 1e-6)
        return torch.sigmoid((self.gate_logit + torch.log(u) - torch.log1p(-u)) / temperature)

    def forward(self, receiver: torch.Tensor, sharer: torch.Tensor, mask: torch.Tensor,
                temperature: float) -> torch.Tensor:
        """``receiver [B, Hr, T, Dr]``, ``sharer [B, Hs, T, Ds]``, ``mask [B|1, T]`` → ``[B, Hr, T, Dr]``."""
        if not self.training and not bool(self.gate_logit > 0):
            return receiver  # hard gate off: exactly the receiver's tensor
        b, hr, t, dr = receiver.shape
        dtype = self.down.weight.dtype
        r_in = receiver.transpose(1, 2).reshape(b, t, hr * dr).to(dtype)
        s_in = sharer.transpose(1, 2).reshape(b, t, -1).to(dtype)
        if self.input_norm:
            r_in, s_in = F.rms_norm(r_in, (r_in.shape[-1],)), F.rms_norm(s_in, (s_in.shape[-1],))
        x = torch.cat([r_in, s_in], dim=-1)
        h = F.silu(self.down(x))
        proj = self.up(h).view(b, t, hr, dr)
        weight = torch.sigmoid(self.head(h)).unsqueeze(-1)
        delta = (self.gate(temperature) * weight * proj).transpose(1, 2).to(receiver.dtype)
        return torch.where(mask[:, None, :, None], receiver + delta, receiver)


class LayerFuser(nn.Module):
    """Fuses one sharer layer into one receiver layer: a key branch and a value branch."""

    def __init__(self, r_heads: int, r_dim: int, s_heads: int, s_dim: int,
                 bottleneck: int = 64, gate_init: float = 0.0, input_norm: bool = False):
        super().__init__()
        self.key = _Branch(r_heads, r_dim, s_heads * s_dim, bottleneck, gate_init, input_norm)
        self.value = _Branch(r_heads, r_dim, s_heads * s_dim, bottleneck, gate_init, input_norm)

    def forward(self, r_keys, r_values, s_keys, s_values, mask, temperature: float = 1.0):
        """Receiver ``[B, Hr, T, Dr]`` and aligned sharer ``[B, Hs, T, Ds]`` K/V, token
        mask ``[B|1, T]`` → fused ``(keys, values)`` shaped like the receiver's."""
        return (self.key(r_keys, s_keys, mask, temperature),
                self.value(r_values, s_values, mask, temperature))


class C2CFuser(nn.Module):
    """All layer fusers of one ordered (receiver, sharer) pair.

    Attributes:
        receiver_spec, sharer_spec: the two caches' shapes.
        config: the :class:`FuserConfig`.
        layer_map: sharer layer of each receiver layer (``None``: not fused).
        layers: ``ModuleDict`` of :class:`LayerFuser`, keyed by ``str(receiver_layer)``.
        temperature: current Gumbel-sigmoid temperature (see :meth:`anneal`).
    """

    def __init__(self, receiver: KVSpec, sharer: KVSpec, config: FuserConfig | None = None):
        super().__init__()
        self.receiver_spec, self.sharer_spec = receiver, sharer
        self.config = config or FuserConfig()
        self.layer_map = layer_mapping(receiver.num_layers, sharer.num_layers, self.config.layer_mapping)
        self.layers = nn.ModuleDict({
            str(i): LayerFuser(receiver.kv_heads[i], receiver.head_dim[i], sharer.kv_heads[j],
                               sharer.head_dim[j], self.config.bottleneck, self.config.gate_init,
                               self.config.input_norm)
            for i, j in enumerate(self.layer_map) if j is not None
        })
        self.temperature = self.config.init_temperature

    def anneal(self, step: int, total_steps: int) -> float:
        """Set and return the temperature at ``step`` of ``total_steps``: exponential
        decay from ``init_temperature`` (step 0) to ``min_temperature`` (the last step)."""
        c = self.config
        frac = min(max(step / max(total_steps, 1), 0.0), 1.0)
        self.temperature = c.init_temperature * (c.min_temperature / c.init_temperature) ** frac
        return self.temperature

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def nbytes(self) -> int:
        """Size of the weights stored as float32."""
        return 4 * self.num_parameters()

    def _check(self, cache: DynamicCache, spec: KVSpec, who: str) -> tuple[int, int]:
        """Validate a cache against its spec; return ``(batch, prompt length)``."""
        layers = list(cache.layers)
        if len(layers) != spec.num_layers:
            raise ValueError(f"the {who} cache has {len(layers)} layers, the fuser expects {spec.num_layers}")
        lengths, batches = set(), set()
        for i, layer in enumerate(layers):
            if layer.keys is None or layer.keys.numel() == 0:
                raise ValueError(f"the {who} cache layer {i} is empty: prefill the prompt first")
            b, h, _, d = layer.keys.shape
            if (h, d) != (spec.kv_heads[i], spec.head_dim[i]) or layer.values.shape != layer.keys.shape:
                raise ValueError(f"the {who} cache layer {i} has keys {tuple(layer.keys.shape)} / values "
                                 f"{tuple(layer.values.shape)}, the fuser expects {spec.kv_heads[i]} heads "
                                 f"of dim {spec.head_dim[i]}")
            lengths.add(layer.get_seq_length())
            batches.add(b)
        if len(lengths) != 1 or len(batches) != 1:
            raise ValueError(f"the {who} cache layers disagree on prompt length {sorted(lengths)} "
                             f"or batch size {sorted(batches)}")
        return batches.pop(), lengths.pop()

    def forward(self, receiver_cache: DynamicCache, sharer_cache: DynamicCache,
                mapping: list[list[int]] | None = None, mask: torch.Tensor | None = None) -> DynamicCache:
        """Fuse the sharer's prompt cache into a copy of the receiver's.

        Args:
            receiver_cache: the receiver's prefill cache (``Tr`` prompt tokens); not modified.
            sharer_cache: the sharer's prefill cache (``Ts`` prompt tokens).
            mapping: token alignment, one list of sharer indices per receiver token
                (:mod:`edgefuse.c2c.align`); ``None`` means the identity (same tokenizer, ``Tr == Ts``).
            mask: optional ``[Tr]`` or ``[B, Tr]`` bool: receiver tokens allowed to be fused
                (combined with "has a sharer token" from the mapping).

        Returns:
            A new ``DynamicCache`` (same layer types and lengths as the receiver's) with
            every mapped layer fused; unmapped layers share the receiver's tensors.

        Raises:
            ValueError: layer count, heads or head_dim differ from the specs; batch sizes
                differ; the mapping's length is not ``Tr`` or it indexes past ``Ts``;
                ``Tr != Ts`` without a mapping; a mask of the wrong shape.
        """
        bsz, tr = self._check(receiver_cache, self.receiver_spec, "receiver")
        s_bsz, ts = self._check(sharer_cache, self.sharer_spec, "sharer")
        if bsz != s_bsz:
            raise ValueError(f"batch sizes differ: receiver {bsz}, sharer {s_bsz}")
        if mapping is None:
            if tr != ts:
                raise ValueError(f"sequence lengths differ (receiver {tr}, sharer {ts}) and no token "
                                 "mapping was given: align the tokenizations (edgefuse.c2c.align)")
            mapping = [[t] for t in range(tr)]
        if len(mapping) != tr:
            raise ValueError(f"the token mapping has {len(mapping)} entries, the receiver prompt has {tr} tokens")
        bad = [s for m in mapping for s in m if not 0 <= s < ts]
        if bad:
            raise ValueError(f"the token mapping indexes sharer tokens {sorted(set(bad))[:5]}, "
                             f"outside the sharer prompt of {ts} tokens")
        device = receiver_cache.layers[0].keys.device
        if mask is None:
            mask = torch.ones(1, tr, dtype=torch.bool, device=device)
        mask = torch.as_tensor(mask, device=device).bool()
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if mask.dim() != 2 or mask.shape[1] != tr or mask.shape[0] not in (1, bsz):
            raise ValueError(f"mask must be [Tr] or [B, Tr] = [{tr}] or [{bsz}, {tr}], got {tuple(mask.shape)}")

        fused = copy_cache(receiver_cache)
        windows: dict[tuple[int, int], list[list[int]]] = {}
        for key, fuser in self.layers.items():
            i, j = int(key), self.layer_map[int(key)]
            r_layer, s_layer = fused.layers[i], sharer_cache.layers[j]
            r0 = tr - r_layer.keys.shape[2]  # first prompt token still in the receiver layer
            s0 = ts - s_layer.keys.shape[2]  # same for the sharer layer (sliding windows)
            if (r0, s0) not in windows:
                windows[(r0, s0)] = [[s - s0 for s in m if s >= s0] for m in mapping[r0:]]
            sub = windows[(r0, s0)]
            s_keys, has = gather_aligned(s_layer.keys, sub, self.config.reduction)
            s_values, _ = gather_aligned(s_layer.values, sub, self.config.reduction)
            keep = mask[:, r0:] & has.unsqueeze(0)
            r_layer.keys, r_layer.values = fuser(r_layer.keys, r_layer.values, s_keys, s_values,
                                                 keep, self.temperature)
        return fused


def control_sharer(control: str, sharer_cache: DynamicCache, mapping: list[list[int]],
                   partner_cache: DynamicCache | None = None) -> tuple[DynamicCache, list[list[int]]]:
    """The sharer input of a control fuser (:attr:`FuserConfig.sharer_control`).

    Args:
        control: ``none`` (returned unchanged), ``zero`` (a cache of the same shapes, all
            zeros, with the same mapping) or ``shuffled`` (``partner_cache``, the sharer's
            cache of *another* prompt, with the mapping rescaled onto its length:
            sharer index ``j`` of a ``Ts``-token prompt becomes ``floor(j * Ts' / Ts)``).
        sharer_cache: this prompt's sharer cache (``Ts`` tokens).
        mapping: this prompt's alignment (:mod:`edgefuse.c2c.align`).
        partner_cache: required for ``shuffled``.

    Returns:
        ``(cache, mapping)`` to pass to :class:`C2CFuser`.

    Raises:
        ValueError: an unknown control, or ``shuffled`` without a partner cache.
    """
    if control == "none":
        return sharer_cache, mapping
    if control == "zero":
        zero = copy_cache(sharer_cache)
        for layer in zero.layers:
            layer.keys, layer.values = torch.zeros_like(layer.keys), torch.zeros_like(layer.values)
        return zero, mapping
    if control == "shuffled":
        if partner_cache is None:
            raise ValueError("the shuffled-sharer control needs another prompt's sharer cache")
        ts, tp = sharer_cache.get_seq_length(), partner_cache.get_seq_length()
        return partner_cache, [sorted({j * tp // ts for j in m}) for m in mapping]
    raise ValueError(f"unknown sharer_control {control!r}: use one of {', '.join(SHARER_CONTROLS)}")


def fuser_size(receiver: KVSpec, sharer: KVSpec, config: FuserConfig | None = None) -> int:
    """Parameter count of the :class:`C2CFuser` for a pair, without building it."""
    config = config or FuserConfig()
    b, total = config.bottleneck, 0
    for i, j in enumerate(layer_mapping(receiver.num_layers, sharer.num_layers, config.layer_mapping)):
        if j is None:
            continue
        r, s, h = receiver.width(i), sharer.width(j), receiver.kv_heads[i]
        branch = (r + s) * b + b + b * r + r + b * h + h + 1
        total += 2 * branch
    return total


# Published shapes of the real edge SLMs (config.json) and their total parameter counts.
REAL_SPECS: dict[str, tuple[KVSpec, int]] = {
    "smollm2-135m": (KVSpec.uniform(30, 3, 64), 134_500_000),
    "gemma3-270m": (KVSpec.uniform(18, 1, 256), 268_000_000),
    "qwen2.5-coder-0.5b": (KVSpec.uniform(24, 2, 64), 630_000_000),
}


def fuser_size_table(config: FuserConfig | None = None) -> list[dict]:
    """Fuser size for every ordered pair of :data:`REAL_SPECS`: one row per pair with
    ``receiver``, ``sharer``, ``fused_layers``, ``params``, ``bytes`` (float32) and
    ``ratio`` (fuser params / receiver params)."""
    config = config or FuserConfig()
    rows = []
    for r_name, (r_spec, r_params) in REAL_SPECS.items():
        for s_name, (s_spec, _) in REAL_SPECS.items():
            if r_name == s_name:
                continue
            n = fuser_size(r_spec, s_spec, config)
            fused = sum(j is not None for j in layer_mapping(r_spec.num_layers, s_spec.num_layers,
                                                             config.layer_mapping))
            rows.append({"receiver": r_name, "sharer": s_name, "fused_layers": fused, "params": n,
                         "bytes": 4 * n, "ratio": n / r_params})
    return rows


def format_size_table(rows: list[dict]) -> str:
    """The rows of :func:`fuser_size_table` as a plain-text table."""
    lines = [f"{'receiver':<20} {'sharer':<20} {'layers':>6} {'params':>10} {'MB':>7} {'% recv':>7}"]
    for r in rows:
        lines.append(f"{r['receiver']:<20} {r['sharer']:<20} {r['fused_layers']:>6} {r['params']:>10,} "
                     f"{r['bytes'] / 1e6:>7.2f} {100 * r['ratio']:>6.2f}%")
    return "\n".join(lines)


__all__ = [
    "SHARER_CONTROLS", "control_sharer", "FuserConfig", "KVSpec", "kv_spec_from_config", "kv_spec_from_cache", "copy_cache",
    "LayerFuser", "C2CFuser", "fused_forward", "fuser_size", "fuser_size_table",
    "format_size_table", "REAL_SPECS",
]
