"""LoRA adapters: attach, read/write state, pack for the wire, save as a PEFT folder.

State keys are peft's saved keys without the ``base_model.model.`` prefix, e.g.
``model.layers.0.self_attn.q_proj.lora_A.weight`` (``[r, in_features]``) and
``...q_proj.lora_B.weight`` (``[out_features, r]``), values float32 numpy arrays.
The update a module adds is ``ΔW = (alpha / r) · B A`` (peft's default scaling, not rsLoRA).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from safetensors.numpy import save_file

from edgefuse import packing
from edgefuse.aggregation import (ClientUpdate, MalformedUpdateError, module_shapes, split_key,
                                  validate_update)
from edgefuse.io import atomic_write_dir
from edgefuse.models import LAYER_KEY

__all__ = [
    "MalformedUpdateError", "PEFT_PREFIX", "PARTS", "attach_lora", "get_adapter_state",
    "set_adapter_state", "pack_adapter", "unpack_adapter", "adapter_nbytes",
    "save_peft_adapter", "lora_scaling", "check_received_adapter", "merge_local_adapter",
    "state_digest", "adapter_hash", "merged_state_dict",
]

# Prefix of peft's keys, in get_peft_model_state_dict and in adapter_model.safetensors.
PEFT_PREFIX = "base_model.model."
PARTS = ("lora_A", "lora_B")


def lora_scaling(rank: int, alpha: float) -> float:
    """``alpha / rank``: the factor peft applies to ``B A`` (not rsLoRA's ``alpha / √rank``).

    Raises:
        ValueError: ``rank <= 0``.
    """
    if rank <= 0:
        raise ValueError(f"rank must be > 0, got {rank}")
    return alpha / rank


def attach_lora(
    model,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    seed: int,
) -> PeftModel:
    """Wrap ``model`` (changed in place) with a fresh LoRA adapter named ``default``.

    ``A`` gets peft's Kaiming-uniform init drawn after ``torch.manual_seed(seed)`` (so one seed
    gives the same ``A`` on every client; note this reseeds torch's global RNG), ``B = 0``.
    """
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules), bias="none")
    torch.manual_seed(seed)
    return get_peft_model(model, config)


def expected_shapes(model_config, target_modules: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of every module an adapter on ``target_modules`` wraps,
    keyed as :func:`edgefuse.aggregation.module_shapes` keys them, from the model's config
    alone: the model and adapter are built on the meta device (no weights, no memory), inside
    a forked RNG (the caller's torch RNG is untouched). What the server checks every update
    against, before any client has sent one.
    """
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        peft = attach_lora(model, rank=1, alpha=1.0, dropout=0.0, target_modules=target_modules, seed=0)
        return module_shapes(_peft_lora_dict(peft))


def _peft_lora_dict(peft_model) -> dict[str, torch.Tensor]:
    # get_peft_model_state_dict drops the adapter name; we keep only A/B weights.
    sd = get_peft_model_state_dict(peft_model)
    out = {}
    for key, value in sd.items():
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"unexpected peft key {key!r} (no {PEFT_PREFIX!r} prefix)")
        key = key[len(PEFT_PREFIX):]
        if key.endswith((".lora_A.weight", ".lora_B.weight")):
            out[key] = value
    return out


def get_adapter_state(peft_model) -> dict[str, np.ndarray]:
    """Float32 numpy copies of the adapter's LoRA weights, keyed as in the module docstring."""
    return {k: v.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
            for k, v in _peft_lora_dict(peft_model).items()}


def set_adapter_state(peft_model, state: dict[str, np.ndarray]) -> None:
    """Load ``state`` (as from :func:`get_adapter_state`) into the adapter, cast to its dtype.

    Raises:
        ValueError: the first missing key, unexpected key, or shape mismatch (sorted key
            order), before anything is written to the model.
    """
    current = _peft_lora_dict(peft_model)
    for key in sorted(set(current) | set(state)):
        if key not in state:
            raise ValueError(f"missing adapter key {key}")
        if key not in current:
            raise ValueError(f"unexpected adapter key {key}")
        if tuple(np.shape(state[key])) != tuple(current[key].shape):
            raise ValueError(f"{key}: shape {tuple(np.shape(state[key]))}, "
                             f"model has {tuple(current[key].shape)}")
    sd = {PEFT_PREFIX + k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
          for k, v in state.items()}
    result = set_peft_model_state_dict(peft_model, sd)
    if result.unexpected_keys:  # cannot happen after the checks above; guard anyway
        raise ValueError(f"peft rejected keys: {result.unexpected_keys[:3]}")


def check_received_adapter(
    state: dict[str, np.ndarray],
    current: dict[str, np.ndarray],
    *,
    model: str,
    rank: int,
    alpha: float,
    claimed_model: str | None = None,
    claimed_rank: int | None = None,
) -> None:
    """Check an adapter received from the server before it replaces this client's own.

    Checked (with :func:`edgefuse.aggregation.validate_update`, the server's check of client
    updates): the group the server says the adapter belongs to (``claimed_model`` /
    ``claimed_rank``, when sent) is this client's ``model`` / ``rank``; every tensor is a 2-D
    float array of finite values (no NaN/Inf); every ``lora_A`` / ``lora_B`` has this
    client's rank; the module set and each module's ``(out, in)`` shape equal those of
    ``current`` (the adapter the client's model carries now). Nothing is changed here, so
    the caller keeps its previous adapter when this raises.

    Raises:
        MalformedUpdateError: the first failed check, as ``adapter from the server refused:
            <reason>``.
    """
    try:
        if claimed_rank is not None and int(claimed_rank) != int(rank):
            raise MalformedUpdateError(f"it is for LoRA rank {claimed_rank}, this client "
                                       f"has rank {rank}")
        upd = ClientUpdate(partition_id=-1, model=str(claimed_model or model), rank=int(rank),
                           alpha=float(alpha), num_examples=1, state=state)
        validate_update(upd, str(model), module_shapes(current))
    except MalformedUpdateError as e:
        reason = str(e).removeprefix("client -1: ")
        raise MalformedUpdateError(f"adapter from the server refused: {reason}") from None


def pack_adapter(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """Pack a state into two flat float32 arrays plus a JSON index.

    Flower's ``ArrayRecord`` sends every array separately, so hundreds of small LoRA tensors
    are slow; two flat arrays are not.

    Returns:
        ``({"lora_A": a, "lora_B": b}, index_json)``: ``a``/``b`` are 1-D float32, the
        tensors of that part concatenated in sorted key order (an empty part is a 0-length
        array). The index is a JSON list of ``{"key", "shape", "part", "offset", "size"}``
        with offsets and sizes in elements.

    Raises:
        MalformedUpdateError: a key that is not a LoRA A/B weight.
    """
    return packing.pack(state, _part_of, PARTS)


def _part_of(key: str) -> str:
    return split_key(key)[1]


def unpack_adapter(arrays: dict[str, np.ndarray], index_json: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_adapter`; returns float32 copies. Other arrays are ignored.

    Raises:
        MalformedUpdateError: index that is not valid JSON or not a list of well-formed
            entries, a missing ``lora_A``/``lora_B`` part, a part that is not a 1-D float
            array, a repeated key, a key whose part disagrees with its name, an entry out of
            bounds, or entries that do not tile each flat array exactly (gap, overlap, or
            sizes that do not add up to its length).
    """
    return packing.unpack(arrays, index_json, PARTS, error=MalformedUpdateError, part_of=_part_of)


def adapter_nbytes(arrays: dict[str, np.ndarray]) -> int:
    """Payload size of the arrays in bytes (sum of ``ndarray.nbytes``)."""
    return int(sum(a.nbytes for a in arrays.values()))


def save_peft_adapter(
    state: dict[str, np.ndarray],
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
) -> Path:
    """Write ``state`` as a standard PEFT folder that ``PeftModel.from_pretrained`` loads.

    The folder holds ``adapter_config.json`` (``LoraConfig.save_pretrained``) and
    ``adapter_model.safetensors`` keyed ``base_model.model.<key>`` (what peft itself writes).
    It is built in a temporary sibling folder and moved into place with ``os.replace``;
    an existing ``out_dir`` is replaced.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: a non-LoRA key, A without B, a shape that does not match ``rank``, or a
            module not covered by ``target_modules`` (peft would silently skip it).
    """
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    for module in module_shapes(state):
        if not any(module == t or module.endswith("." + t) for t in targets):
            raise ValueError(f"module {module} is not matched by target_modules {targets}")
    for key, value in state.items():
        r = np.shape(value)[0] if split_key(key)[1] == "lora_A" else np.shape(value)[1]
        if r != rank:
            raise ValueError(f"{key} has shape {np.shape(value)}, which does not match rank {rank}")
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, target_modules=targets,
                        bias="none", base_model_name_or_path=base_model_name_or_path,
                        inference_mode=True)
    out = Path(out_dir).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_dir(out) as tmp:
        config.save_pretrained(tmp)
        save_file({PEFT_PREFIX + k: np.ascontiguousarray(v, dtype=np.float32)
                   for k, v in state.items()},
                  tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    return out



def merge_local_adapter(model, adapter_dir: str | os.PathLike, layers: Sequence[int]):
    """Merge a PEFT LoRA folder into ``model``'s decoder ``layers`` only, and return the
    plain model (``merge_and_unload``): the split-inference device adapts the target layers it
    runs; the cloud's middle layers stay the base model's, and the adapter never leaves the
    device.

    Every adapted module must sit in one of ``layers`` (read from the folder's safetensors
    keys, ``...layers.<i>...lora_A/B...``), since a module of another layer runs where the
    adapter is not.

    Raises:
        ValueError: no folder or no ``adapter_config.json`` / ``adapter_model.safetensors``,
            not a LoRA adapter, ``modules_to_save`` or biases (weights beyond the layers),
            or an adapted module outside ``layers`` (named).
    """
    from safetensors import safe_open

    folder = Path(adapter_dir).expanduser()
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"{folder}: not a PEFT adapter folder (adapter_config.json and "
                         f"adapter_model.safetensors needed)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{cfg_path}: unreadable ({exc})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise ValueError(f"{folder}: only a LoRA adapter can be merged into the device's layers")
    if cfg.get("modules_to_save") or cfg.get("bias", "none") != "none":
        raise ValueError(f"{folder}: modules_to_save / biases change weights outside the LoRA "
                         f"modules, which a split device cannot hold")
    if cfg.get("use_dora"):
        raise ValueError(f"{folder}: a DoRA adapter is not merged into a split device's layers "
                         f"(only plain LoRA)")
    keep = {int(i) for i in layers}
    try:
        with safe_open(str(weights), "pt") as f:
            keys = list(f.keys())
    except Exception as exc:  # safetensors' own error types: a corrupt or truncated file
        raise ValueError(f"{weights}: unreadable ({type(exc).__name__}: {str(exc)[:120]})") from None
    for key in keys:
        hit = LAYER_KEY.search(key)
        if not any(p in key for p in PARTS) or hit is None:
            raise ValueError(f"{folder}: {key} is not a LoRA weight of a decoder layer")
        if int(hit.group(1)) not in keep:
            raise ValueError(f"{folder}: {key} adapts layer {hit.group(1)}, outside the device's "
                             f"layers {sorted(keep)}")
    try:
        peft = PeftModel.from_pretrained(model, str(folder))
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # shapes or config of another model
        raise ValueError(f"{folder}: does not fit this model ({str(exc).splitlines()[0][:160]})") from None
    # every weight in the file is used and every module the config adapts has its weights
    expected = set(get_peft_model_state_dict(peft))
    if expected != set(keys):
        odd = sorted(set(keys) - expected) or sorted(expected - set(keys))
        what = "unused by its config" if set(keys) - expected else "missing from the file"
        raise ValueError(f"{folder}: {len(odd)} LoRA weight(s) {what}, e.g. {odd[0]}")
    return peft.merge_and_unload().eval()


def state_digest(state: dict) -> str:
    """Full sha256 (hex) of a state dict as float32: what :func:`adapter_hash` truncates.

    Per key in sorted order: a JSON header ``[key, shape, "<f4"]``, the byte count, then the
    values as little-endian float32. So the digest depends on keys, shapes and values only,
    not on the in-memory dtype (a float64 copy of the same float32 values hashes the same).
    Accepts numpy arrays or CPU torch tensors.
    """
    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", torch.float32).numpy()
        a = np.ascontiguousarray(value, dtype="<f4")
        h.update(json.dumps([key, list(a.shape), "<f4"]).encode())
        h.update(a.nbytes.to_bytes(8, "little"))
        h.update(a.tobytes())
    return h.hexdigest()


def adapter_hash(state: dict[str, np.ndarray] | None) -> str:
    """Short stable id of a LoRA adapter state: ``state_digest(state)[:16]``; ``"base"`` for
    ``None`` (no adapter: the base model). An empty dict is an adapter with no modules and
    hashes like any other state."""
    return "base" if state is None else state_digest(state)[:16]


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's weights with the active LoRA updates added (``W + (alpha / r) · B A``,
    peft's own ``get_delta_weight``), named as the base model's checkpoint; ``model`` is left
    as it was (nothing merged in place, so training can go on).

    Args:
        model: a ``PeftModel`` (or a plain model: its own weights).

    Raises:
        ValueError: a DoRA adapter (its update depends on the weight norm; export a merged
            copy instead) or an adapter with ``modules_to_save``.
    """
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    for name, config in model.peft_config.items():
        if getattr(config, "use_dora", False):
            raise ValueError(f"adapter {name!r} is a DoRA adapter; only plain LoRA is merged for export")
        if getattr(config, "modules_to_save", None):
            raise ValueError(f"adapter {name!r} has modules_to_save; only plain LoRA is merged for export")
    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not getattr(module, "merged", False):
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        d = module.get_delta_weight(adapter).detach()
                        deltas[name + ".weight"] = deltas.get(name + ".weight", 0) + d
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = value.detach() + deltas[key] if key in deltas else value.detach()
    return out
