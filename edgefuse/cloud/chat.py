"""``edgefuse cloud generate``: complete one prompt or chat through the cloud link.

The edge model (optionally with a LoRA adapter folder from a run's ``adapters/``) runs in
this process; the cloud service must be running (``edgefuse cloud serve``). As in the main
job, each prompt is protected on the device before anything goes toward the cloud
(``--protection``, default the main job's ``privacy.protection``: redacted and/or
rephrased, :mod:`edgefuse.privacy.protect`; the answer gets the original values back) and
every request carries the device's cache authorization (``--flag-cache`` / ``--l-cache``,
default ``privacy.cloud_auth``). Every reply prints the decoding figures: tokens/s, ms per
token, round trips, bytes each way per token, acceptance rate.

The link is authenticated (:mod:`edgefuse.cloud.wire`) with the identity and trust store of a
device home (``--device-dir``: ``identity.key`` and ``trust.json``, as ``provision`` writes
them): the cloud must present the key pinned there as ``cloud``. ``--trust-on-first-use``:
when that home pins no cloud key yet, the command prints the presented key's fingerprint and
pins it (compare it with ``edgefuse keys`` on the cloud's side). The cloud serves the device
only if its key is in the cloud's authorized devices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from edgefuse.cloud.decoding import MODES, DecodeConfig, DecodeResult, Decoder, EdgeLM, auth_from_config
from edgefuse.cloud.decoding.config import SPLIT_MODES
from edgefuse.cloud.fusion import FusionConfig
from edgefuse.cloud import protocol as P
from edgefuse.cloud.protocol import CloudAuth
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.privacy.protect import check_mode, client_protection, join_placeholders, protect
from edgefuse.privacy.redact import restore
from edgefuse.transport.identity import (CLOUD, IDENTITY_FILE, TRUST_FILE, Identity,
                                         IdentityError, TrustStore, fingerprint, load_identity)


def load_edge(model: str, adapter: str | None = None, cache_dir: str | None = None):
    """``(model, tokenizer)`` of the edge SLM, with the PEFT ``adapter`` folder applied.

    Raises ``FileNotFoundError`` for a missing adapter folder, ``ModelSpecError`` for an
    unknown model name."""
    from pathlib import Path

    from edgefuse.models import load_model

    m, tok = load_model(model, cache_dir)
    if adapter:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json); "
                                    "use a run's adapters/round_NNN/<model> folder")
        from peft import PeftModel

        m = PeftModel.from_pretrained(m, adapter).merge_and_unload()
    return m.eval(), tok


def figures(res: DecodeResult) -> str:
    """One line of the decoding figures of ``res``."""
    acc = "" if res.acceptance_rate is None else f", acceptance {res.acceptance_rate:.2f}"
    w = "" if res.edge_weight_mean is None else f", edge weight {res.edge_weight_mean:.2f}"
    miss = f", {res.deadline_misses} deadline misses" if res.deadline_misses else ""
    out = (f"[{res.mode}] {len(res.tokens)} tokens, {res.tokens_per_s:.2f} tok/s, "
           f"{res.ms_per_token:.0f} ms/token, {res.round_trips_per_token:.2f} round trips/token, "
           f"{res.bytes_up_per_token:.0f} B up + {res.bytes_down_per_token:.0f} B down per token{acc}{w}{miss}")
    if res.fallback:
        out += f"\n  note: {res.fallback}"
    return out


def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tok(text)["input_ids"]


def device_keys(device_dir, trust_on_first_use: bool = False) -> tuple[Identity, TrustStore]:
    """The identity and trust store of the device home ``device_dir``. With
    ``trust_on_first_use`` a missing identity is created there (a new device); otherwise
    the home must be provisioned. Raises :class:`IdentityError` (no identity, a bad key file
    or trust store)."""
    if not device_dir:
        raise IdentityError("no device home: pass --device-dir (a provisioned device folder)")
    home = Path(device_dir).expanduser()
    return (load_identity(home / IDENTITY_FILE, create=trust_on_first_use),
            TrustStore.load(home / TRUST_FILE))


def privacy_settings(args, cfg) -> tuple[str, CloudAuth]:
    """The protection mode and cloud cache tuple of the command: ``args.protection``,
    ``args.flag_cache`` and ``args.l_cache`` where given (None = not given), else the
    ``privacy`` group of ``cfg`` (the main job's defaults, :func:`client_protection`,
    :func:`auth_from_config`).

    Raises:
        ValueError: an unknown protection mode, or ``--l-cache`` below 1 (under 0 the cloud
            could score nothing).
    """
    mode = check_mode(args.protection) if args.protection is not None else client_protection(cfg)
    auth = auth_from_config(cfg.get("privacy"))
    if args.l_cache is not None and not 1 <= args.l_cache < P.L_UNLIMITED:
        raise ValueError(f"--l-cache must be in 1..{P.L_UNLIMITED - 1}, got {args.l_cache}")
    flag = auth.flag_cache if args.flag_cache is None else bool(args.flag_cache)
    return mode, CloudAuth(flag, auth.l_cache if args.l_cache is None else int(args.l_cache))


def run(args) -> int:
    """The command (arguments from :func:`edgefuse.cli.main`); returns the exit status.

    Models load from, and the draft head's corpus comes from, what
    :func:`edgefuse.config.resolve_paths` gives ``--cache-dir`` / ``--data-mirror``. When a
    mode uses the cloud, each prompt is protected (:func:`privacy_settings`) before it is
    tokenized: the protected text is what every mode decodes from (so the modes stay
    comparable), a note on stderr shows it, and the printed answer has the placeholders'
    values put back. The chat history keeps the protected turns and the unrestored answers,
    with one placeholder numbering over the whole chat (:func:`join_placeholders`).
    """
    from edgefuse.transport.wan import WanProfile

    from edgefuse.cloud.link import CloudLink, CloudUnavailable

    from edgefuse.config import compose, resolve_paths

    if args.threads:
        torch.set_num_threads(args.threads)
    # "all": every mode of the edge model; the split ones load the target's layers, asked by name
    modes = [m for m in MODES if m not in SPLIT_MODES] if args.mode == "all" else [args.mode]
    paths = resolve_paths(data_mirror=getattr(args, "data_mirror", None),
                          cache_dir=getattr(args, "cache_dir", None))
    job = compose("default")  # the main job's settings: the privacy defaults, the corpus
    protection, auth = privacy_settings(args, job)
    # settings and keys are checked before any model loads: a bad one fails in a second
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       gamma=args.gamma, seed=args.seed,
                       fusion=FusionConfig(weight=args.fusion_weight, confidence=args.confidence),
                       deadline_ms=args.deadline_ms, auth=auth)
    uses_link = any(m != "edge" for m in modes)
    if uses_link:
        identity, trust = device_keys(args.device_dir, bool(args.trust_on_first_use))
    edge_lm = None
    if getattr(args, "profile", "cpu") == "edge":  # the same model, exported and run by ONNX Runtime
        from edgefuse.cloud.decoding import OnnxEdgeLM
        from edgefuse.export import export_onnx, load_adapted
        from edgefuse.runtime import OnnxDecoder

        model, tok = load_adapted(args.model, args.adapter, paths.cache_dir)
        ex = export_onnx(args.model, args.quant, model=model if args.adapter else None,
                         tok=tok if args.adapter else None, root=paths.cache_dir, threads=args.threads)
        edge_lm = OnnxEdgeLM(OnnxDecoder(ex.folder, threads=args.threads or 1), tok)
        if args.draft_head:
            print("edgefuse: note: the edge profile drafts with the full head (int8 in the graph); "
                  "--draft-head is ignored", file=sys.stderr)
            args.draft_head = 0
    else:
        model, tok = load_edge(args.model, args.adapter, paths.cache_dir)
    head = None
    if args.draft_head:
        from edgefuse.cloud.devices import pruned_head

        resolve_paths(job, data_mirror=paths.data_mirror or "hub", cache_dir=paths.cache_dir)
        head = pruned_head(model, tok, job.data, int(job.seed), args.draft_head, job.paths.cache_dir)
    split = None
    if set(modes) & set(SPLIT_MODES):  # the target's first and last layers run here
        from edgefuse.cloud.decoding.split import SplitSettings, load_split_device

        split = load_split_device(args.target, SplitSettings(
            k=args.split_k, m=args.split_m, head_split=args.head_split, act=args.split_act,
            mask=args.mask, mask_size=args.mask_size, head_topk=args.head_topk, fill=args.fill,
            stream_block=args.stream_block, adapter=args.split_adapter), root=paths.cache_dir)
        if args.mask == "corpus":
            from edgefuse.cloud.devices import with_corpus_mask

            resolve_paths(job, data_mirror=paths.data_mirror or "hub", cache_dir=paths.cache_dir)
            split = with_corpus_mask(split, job.data, int(job.seed), job.paths.cache_dir)
    link = None
    if uses_link:
        pinned = CLOUD in trust.names()
        try:
            link = CloudLink.connect(args.host, args.port, wan=WanProfile.from_name(args.wan),
                                     identity=identity, trust=trust,
                                     trust_on_first_use=bool(args.trust_on_first_use))
            if not pinned:
                trust.save()
                print(f"pinned the cloud's key {fingerprint(link.cloud_identity)} in {trust.path} "
                      "(trust on first use: compare it with the cloud operator's)", file=sys.stderr)
        except CloudUnavailable as e:
            print(f"edgefuse: error: no cloud service at {args.host}:{args.port} ({e}). Start one with "
                  f"`edgefuse cloud serve --model qwen2.5-coder-1.5b --port {args.port}`, "
                  "or use --mode edge", file=sys.stderr)
            return 1
    else:
        protection = "off"  # nothing leaves the device
    redactor = None
    if protection in ("redact", "both"):
        from edgefuse.privacy.redact import Redactor

        redactor = Redactor.from_config(job)
    cross, fp, cloud_tok = None, tokenizer_fingerprint(tok), None
    if link is not None:  # a device of another tokenizer decodes across the vocabularies
        from edgefuse.cloud.crossvocab import CrossVocab
        from edgefuse.models import load_tokenizer

        from edgefuse.cloud.link import cloud_health
        from edgefuse.models import ModelFetchError, ModelSpecError

        # the model the service says it serves (its public health answer); a tokenizer not
        # held here means this one: the authenticated OPEN's fingerprint check decides either way
        try:
            served = str(cloud_health(args.host, args.port, timeout_s=5.0).get("model") or args.target)
            cloud_tok = load_tokenizer(served, paths.cache_dir, allow_fetch=False)
        except (CloudUnavailable, OSError, ValueError, ModelSpecError, ModelFetchError):
            cloud_tok = tok
        if tokenizer_fingerprint(cloud_tok) != fp:
            cross, fp = CrossVocab(tok, cloud_tok), tokenizer_fingerprint(cloud_tok)
    dec = Decoder(edge_lm or EdgeLM(model, tok, head=head), link, fp,
                  rtt_ms=WanProfile.from_name(args.wan).rtt_ms, split=split, cross=cross)
    history: list[dict] = []
    mapping: dict[str, str] = {}  # placeholder -> value over the whole chat; stays here
    try:
        while True:
            if args.prompt is not None:
                text = args.prompt
            else:
                try:
                    text = input("you> ").strip()
                except EOFError:
                    break
                if text in ("", "/quit", "/exit"):
                    break
            if protection != "off":
                p = protect(text, protection, model=model, tok=tok, redactor=redactor,
                            max_new_tokens=int(job.privacy.rephrase.max_new_tokens))
                text, mapping = join_placeholders(mapping, p.text, p.mapping)
                fell = ", rephrasing fell back to the input" if p.rephrased_fell_back else ""
                print(f"[protection {protection}{fell}] sent: {text}", file=sys.stderr)
            history.append({"role": "user", "content": text})
            ids = _prompt_ids(tok, history)
            reply = None
            for mode in modes:
                res = dec.generate(mode, ids, cfg,
                                   cloud_prompt=_prompt_ids(cloud_tok, history) if cross else None)
                shown = restore(res.text, mapping)
                print(f"{mode}> {shown}" if len(modes) > 1 or args.prompt is None else shown)
                print(figures(res), file=sys.stderr)
                reply = reply if reply is not None else res.text
            history.append({"role": "assistant", "content": reply or ""})
            if args.prompt is not None:
                break
    finally:
        if link is not None:
            link.close()
    return 0
