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
import hashlib
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


KEEP = 2  # exports kept per model and quantization: the newest and the one before


def export_folder(name: str, quant: str, key: str, root=None) -> Path:
    """Where the export of model ``name`` at ``quant`` with cache id ``key`` (:func:`export_key`)
    lives."""
    return cache_dir(root) / "onnx" / name / f"{quant}-{key}"


def export_key(name: str, model=None, root=None) -> tuple[str, str]:
    """``(adapter, key)``: the adapter id an export holds (``base``, the LoRA's
    :func:`~edgefuse.lora.adapter_hash`, or ``weights-<hash>`` of a plain model) and the cache
    id: the adapter id plus a hash of everything else that decides the graph — the model's
    config, the LoRA config (rank, alpha, rsLoRA, DoRA, targets), the registered weights'
    checksum and the builder's version. A changed alpha or RoPE base is a new export.

    Raises:
        edgefuse.models.ModelSpecError / ModelFetchError: unknown or unfetched model.
    """
    from edgefuse.lora import adapter_hash, get_adapter_state, state_digest

    spec = get_spec(name)
    facts = {"builder": _version("onnxruntime-genai"), "model": name}
    if model is None:
        adapter = "base"
        if spec.tiny:
            facts["config"] = _config_facts(tiny_model(spec.arch, tokenizer=spec.tokenizer)[0].config.to_dict())
        else:
            from edgefuse.models import resolve_path

            src = Path(resolve_path(spec, root))
            facts["config"] = _config_facts(json.loads((src / "config.json").read_text()))
            stamp = src / "edgefuse.json"
            facts["weights"] = json.loads(stamp.read_text()).get("gguf_sha256") if stamp.is_file() else None
    else:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # save_pretrained (the export's first step) fills in `architectures`: set it here as well
        facts["config"] = {**_config_facts(base.config.to_dict()), "architectures": [type(base).__name__]}
        if hasattr(model, "peft_config"):
            adapter = adapter_hash(get_adapter_state(model))
            facts["lora"] = {k: {f: _jsonable(getattr(c, f, None)) for f in
                                 ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules",
                                  "fan_in_fan_out", "rank_pattern", "alpha_pattern")}
                             for k, c in sorted(model.peft_config.items())}
        else:
            adapter = "weights-" + state_digest(model.state_dict())[:16]
    text = json.dumps(facts, sort_keys=True, default=str)
    return adapter, f"{adapter}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _config_facts(config: dict) -> dict:
    """A model config without the fields that name a path, a version or a load dtype."""
    drop = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}
    return {k: v for k, v in config.items() if k not in drop}


def _jsonable(value):
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def is_exported(folder: Path) -> bool:
    """Whether ``folder`` holds a complete export: its metadata (written last) lists every file
    with its size, and every file is there at that size (a truncated or missing file is a
    rebuild, not a crash at load)."""
    try:
        files = json.loads((folder / EXPORT_META).read_text())["files"]
        return bool(files) and all((folder / f).stat().st_size == int(n) for f, n in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def check_exportable(name: str, quant: str) -> None:
    """Raise :class:`ProfileError` (one line) for an unknown ``quant``, an architecture the
    builder does not build, or a machine without ONNX Runtime GenAI; before any weight is
    loaded."""
    if quant not in QUANTS:
        raise ProfileError(f"unknown quantization {quant!r}: choose from {', '.join(QUANTS)}")
    spec = get_spec(name)
    if spec.arch not in ARCHS:
        raise ProfileError(f"model {name} ({spec.arch or 'unknown architecture'}) cannot be exported: "
                           f"the edge runtime builds {', '.join(ARCHS)}")
    check_edge()


def export_onnx(name: str, quant: str = "int8", model=None, tok=None, root=None,
                force: bool = False, threads: int | None = None) -> Export:
    """Export model ``name`` (a registered name) to ONNX at ``quant``, or reuse the export.

    Args:
        name: the registered model (:data:`edgefuse.models.REGISTRY`), the cache key.
        quant: ``fp32``, ``int8`` or ``int4`` weights.
        model / tok: the device's model and tokenizer: a ``PeftModel`` (its active LoRA is merged;
            the export is keyed by the adapter's hash and config) or a plain model (keyed by a
            hash of all its weights); None = the registered base weights.
        root: the cache root (default :func:`edgefuse.models.cache_dir`).
        force: rebuild even when a complete export exists.
        threads: torch threads while building (default: unchanged).

    Returns:
        an :class:`Export`. After a build, only the newest :data:`KEEP` adapter exports of this
        model and quantization stay (base-weight exports stay too), and leftovers of killed
        exports older than an hour are removed.

    Raises:
        ProfileError: see :func:`check_exportable`; the builder failing.
        ValueError: a DoRA adapter (see :func:`~edgefuse.lora.merged_state_dict`).
        edgefuse.models.ModelSpecError / ModelFetchError: unknown or unfetched model.
    """
    check_exportable(name, quant)
    spec = get_spec(name)
    adapter, key = export_key(name, model, root)
    folder = export_folder(name, quant, key, root)
    if is_exported(folder) and not force:
        return Export(folder, adapter, 0.0, True)
    _sweep(folder.parent)
    t0 = time.perf_counter()
    with atomic_write_dir(folder) as out, \
            tempfile.TemporaryDirectory(prefix=".edgefuse-export-", dir=folder.parent) as tmp:
        source = _source_folder(spec, model, tok, Path(tmp) / "src", root)
        _build(source, out, quant, Path(tmp) / "hf", threads)
        export_s = time.perf_counter() - t0
        files = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}
        atomic_write_json(out / EXPORT_META, {
            "model": name, "quant": quant, "adapter": adapter, "key": key, "export_s": round(export_s, 2),
            "builder": _version("onnxruntime-genai"), "onnxruntime": _version("onnxruntime"), "files": files})
    _prune(folder)
    log.info("exported %s (%s, adapter %s) in %.1f s to %s", name, quant, adapter, export_s, folder)
    return Export(folder, adapter, export_s, False)


def _prune(kept: Path) -> None:
    """Keep the newest :data:`KEEP` adapter exports of ``kept``'s model and quantization
    (``kept`` always; base-weight exports are never pruned)."""
    import shutil

    quant = kept.name.split("-", 1)[0]
    adapters = sorted((p for p in kept.parent.glob(f"{quant}-*")
                       if p.is_dir() and not p.name.startswith(f"{quant}-base-")),
                      key=lambda p: (p == kept, p.stat().st_mtime), reverse=True)
    for old in adapters[KEEP:]:
        if old != kept:
            shutil.rmtree(old, ignore_errors=True)


def _sweep(parent: Path, age_s: float = 3600.0) -> None:
    """Remove what killed exports left in ``parent`` (half-built folders, merged weights) once
    they are ``age_s`` old; a younger one may belong to an export still running."""
    import shutil

    if not parent.is_dir():
        return
    now = time.time()
    for p in list(parent.glob(".*.tmp-*")) + list(parent.glob(".edgefuse-export-*")):
        try:
            if now - p.stat().st_mtime > age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


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
    spec = get_spec(name)
    base = config.get("base_model_name_or_path")
    if base and base not in {spec.name, spec.hub_id} and \
            Path(str(base)).expanduser().resolve() != model_dir(spec, root).resolve():
        raise ValueError(f"{folder}: an adapter of {base}, not of {name}")
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(folder)).eval(), tok
    except Exception as exc:  # peft's, torch's and safetensors' own errors: a misfit or corrupt file
        first = (str(exc).splitlines() or [""])[0][:160]
        raise ValueError(f"{folder}: cannot be applied to {name} ({type(exc).__name__}: {first})") from None


def _source_folder(spec, model, tok, tmp: Path, root) -> Path:
    """A Hugging Face folder the builder reads: the registered model's own folder when the base
    weights are exported, else the merged weights written to ``tmp``."""
    import shutil

    from edgefuse.lora import merged_state_dict

    if model is None and not spec.tiny:
        from edgefuse.models import resolve_path

        return Path(resolve_path(spec, root))
    if model is None:
        model, tok = tiny_model(spec.arch, tokenizer=spec.tokenizer)
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
    # the quantizer logs every tensor (and an ERROR per embedding it leaves in float): into the log
    quiet = [logging.getLogger(n) for n in ["onnxruntime", *logging.root.manager.loggerDict]
             if n.startswith("onnxruntime")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
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
        for q, level in zip(quiet, levels):
            q.setLevel(level)
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
