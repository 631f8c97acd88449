"""Export a device's language model to ONNX for the ``edge`` profile (:mod:`edgefuse.runtime`).

The graph is built by ONNX Runtime GenAI's model builder (``onnxruntime_genai.models.builder``,
the library's own exporter for Llama / Qwen2 / Gemma 3 decoders): fused ``GroupQueryAttention``
and, for ``int8`` / ``int4``, weight-only ``MatMulNBits`` (block-wise, 32 weights per scale,
the LM head included). edgefuse only prepares its input: the base weights with the current
LoRA adapter merged (:func:`edgefuse.lora.merged_state_dict`), and a Gemma 3 config in the
form the builder reads. Every layer keeps a full-length KV cache (``windowed_kv_cache=false``)
so that a rollback is a slice.

Exports are cached under ``<cache>/onnx/<model>/<quant>-<adapter>`` where ``<adapter>`` is
``base``, the adapter's :func:`~edgefuse.lora.adapter_hash` (or ``weights-<hash>`` of a model
given with weights of its own): the same adapter reuses the
export, a new one (the next round's) re-exports. A folder is built beside its place and
renamed in (:func:`edgefuse.io.atomic_write_dir`), so a killed export leaves nothing half-made.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from edgefuse.io import atomic_write_dir, atomic_write_json
from edgefuse.models import cache_dir, get_spec, model_dir, tiny_model
from edgefuse.runtime import EXPORT_META, QUANTS, ProfileError, check_edge

log = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "gemma3_text")  # what the builder builds and edgefuse has checked
_SUPPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class Export:
    """One export: its ``folder``, the ``adapter`` id it holds (``base`` or a hash),
    ``export_s`` (seconds this call spent building; 0 when ``reused``)."""

    folder: Path
    adapter: str
    export_s: float
    reused: bool


def export_folder(name: str, quant: str, adapter: str = "base", root=None) -> Path:
    """Where the export of model ``name`` at ``quant`` with adapter id ``adapter`` lives."""
    return cache_dir(root) / "onnx" / name / f"{quant}-{adapter}"


def is_exported(folder: Path) -> bool:
    """Whether ``folder`` holds a complete export (its metadata file is written last)."""
    return all((folder / f).is_file() for f in ("model.onnx", "genai_config.json", EXPORT_META))


def export_onnx(name: str, quant: str = "int8", model=None, tok=None, root=None,
                force: bool = False, threads: int | None = None) -> Export:
    """Export model ``name`` (a registered name) to ONNX at ``quant``, or reuse the export.

    Args:
        name: the registered model (:data:`edgefuse.models.REGISTRY`), the cache key.
        quant: ``fp32``, ``int8`` or ``int4`` weights.
        model / tok: the device's model and tokenizer: a ``PeftModel`` (its active LoRA is merged;
            the export is keyed by the adapter's hash) or a plain model (keyed by a hash of all
            its weights); None = the registered base weights.
        root: the cache root (default :func:`edgefuse.models.cache_dir`).
        force: rebuild even when a complete export exists.
        threads: torch threads while building (default: unchanged).

    Returns:
        an :class:`Export`.

    Raises:
        ProfileError: an unknown ``quant``, an architecture the builder does not build, or
            ONNX Runtime GenAI missing.
        ValueError: a DoRA adapter (see :func:`~edgefuse.lora.merged_state_dict`).
        edgefuse.models.ModelSpecError / ModelFetchError: unknown or unfetched model.
    """
    from edgefuse.lora import adapter_hash, get_adapter_state, state_digest

    if quant not in QUANTS:
        raise ProfileError(f"unknown quantization {quant!r}: choose from {', '.join(QUANTS)}")
    spec = get_spec(name)
    if spec.arch not in ARCHS:
        raise ProfileError(f"model {name} ({spec.arch}) cannot be exported: the edge runtime builds "
                           f"{', '.join(ARCHS)}")
    check_edge()
    if model is None:
        adapter = "base"
    elif hasattr(model, "peft_config"):
        adapter = adapter_hash(get_adapter_state(model))
    else:  # weights of its own (e.g. merged elsewhere): keyed by all of them
        adapter = "weights-" + state_digest(model.state_dict())[:16]
    folder = export_folder(name, quant, adapter, root)
    if is_exported(folder) and not force:
        return Export(folder, adapter, 0.0, True)
    t0 = time.perf_counter()
    with atomic_write_dir(folder) as out, tempfile.TemporaryDirectory(prefix="edgefuse-export-") as tmp:
        source = _source_folder(spec, model, tok, Path(tmp) / "src", root)
        _build(source, out, quant, Path(tmp) / "hf", threads)
        export_s = time.perf_counter() - t0
        atomic_write_json(out / EXPORT_META, {
            "model": name, "quant": quant, "adapter": adapter, "export_s": round(export_s, 2),
            "builder": _version("onnxruntime-genai"), "onnxruntime": _version("onnxruntime")})
    log.info("exported %s (%s, adapter %s) in %.1f s to %s", name, quant, adapter, export_s, folder)
    return Export(folder, adapter, export_s, False)


def load_adapted(name: str, adapter_dir=None, root=None):
    """``(model, tokenizer)`` of registered model ``name`` with the PEFT LoRA folder
    ``adapter_dir`` applied but not merged (so :func:`export_onnx` keys the export by the
    adapter's hash); None = the base model.

    Raises:
        ValueError: not a PEFT LoRA folder, or one that does not fit the model.
        edgefuse.models.ModelSpecError / ModelFetchError: unknown or unfetched model.
    """
    from edgefuse.models import load_model

    model, tok = load_model(name, root)
    if adapter_dir is None:
        return model, tok
    folder = Path(adapter_dir).expanduser()
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"{folder} is not a PEFT adapter folder (no readable adapter_config.json); "
                         "use a run's adapters/round_NNN/<model> folder") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{folder}: only a LoRA adapter is merged for export")
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(folder)).eval(), tok
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}: does not fit {name} ({str(exc).splitlines()[0][:160]})") from None


def _source_folder(spec, model, tok, tmp: Path, root) -> Path:
    """A Hugging Face folder the builder reads: the registered model's own folder when the base
    weights are exported, else the merged weights written to ``tmp``."""
    import shutil

    from edgefuse.lora import merged_state_dict

    if model is None and not spec.tiny:
        from edgefuse.models import resolve_path

        return Path(resolve_path(spec, root))
    if model is None:
        model, tok = tiny_model(spec.arch)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tmp.mkdir(parents=True)
    base.save_pretrained(tmp, state_dict=merged_state_dict(model))
    if tok is not None:
        tok.save_pretrained(tmp)
    elif not spec.tiny:
        src = model_dir(spec, root)
        for f in _SUPPORT_FILES:
            if (src / f).is_file() and not (tmp / f).exists():
                shutil.copy(src / f, tmp / f)
    return tmp


def _build(source: Path, out: Path, quant: str, hf_cache: Path, threads: int | None) -> None:
    """Run the model builder on ``source`` into ``out`` (its chatter goes to ``out/export.log``)."""
    import torch
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    quiet = logging.getLogger("onnxruntime")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with open(out / "export.log", "w") as sink, contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            opts = parse_extra_options(None, str(source), str(out), quant, "cpu", str(hf_cache),
                                       ["windowed_kv_cache=false"])
            _builder_config(opts["hf_details"]["hf_config"])
            create_model(None, str(source), str(out), quant, "cpu", str(hf_cache), **opts)
    except Exception as exc:  # the builder's own errors: say which export and where its log is
        raise ProfileError(f"export of {source.name} failed ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from exc
    finally:
        torch.set_num_threads(previous)
        quiet.setLevel(level)
    for f in os.listdir(out):  # the builder copies tokenizer files; keep only what runs
        if f.endswith(".jinja"):
            (out / f).unlink()


def _builder_config(config) -> None:
    """Give the builder a Gemma 3 config in the form it reads: transformers 5 nests the RoPE
    parameters per layer type (``rope_parameters = {full_attention: .., sliding_attention: ..}``);
    the builder wants flat ``rope_parameters`` / ``rope_theta`` (global layers) and
    ``rope_local_base_freq`` (sliding layers)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        full, local = rope["full_attention"], rope.get("sliding_attention", rope["full_attention"])
        config.rope_parameters = dict(full)
        config.rope_theta = full["rope_theta"]
        config.rope_local_base_freq = local["rope_theta"]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "missing"
