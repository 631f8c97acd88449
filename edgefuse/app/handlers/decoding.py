"""Device side of cloud collaboration: decode the server's prompts through the cloud service.

The device opens its own encrypted link(s) to the service named in the message
(:mod:`edgefuse.cloud.link`), authenticated with its own identity and the cloud key its own
trust store pins (:class:`edgefuse.app.device.DeviceHome`: never a key or a folder from the
server's message or config); its model keeps the LoRA adapter the message carried, which never
leaves the device. ``cloud.devices`` sessions run at once, sharing this model's weights.
The speculative modes draft with the configured drafter (``cloud.decode.drafter``,
:func:`device_drafter`). A device whose tokenizer is not the cloud's decodes across the two
vocabularies (:func:`cloud_vocabulary`, :mod:`edgefuse.cloud.crossvocab`).

Privacy: every prompt is protected on the device before it goes toward the cloud
(:func:`edgefuse.privacy.protect.protect_batch` with this client's protection mode: the
instruction redacted and/or rephrased, a context redacted), the placeholder mapping stays
here and the answers get the original values back. Every request carries the device's
KV-cache authorization (``privacy.cloud_auth``). With privacy on, a few canary prompts
(synthetic identities) are decoded too, so the outbound audit checks live frames for them;
their outputs are dropped.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from edgefuse.app.device import DeviceHome
from edgefuse.cloud.decoding import DraftHead, DrafterSpec, auth_from_config, decode_config, drafter_spec
from edgefuse.cloud.decoding.config import SPLIT_MODES
from edgefuse.cloud.decoding.split import load_split_device, settings_from_config
from edgefuse.cloud.devices import pruned_head, run_devices, with_corpus_mask
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.privacy.audit import watch_canaries
from edgefuse.privacy.protect import client_protection, join_placeholders, protect_batch
from edgefuse.privacy.redact import restore
from edgefuse.transport.wan import WanProfile
from edgefuse.eval.queries import Query


def protect_queries(queries: list[Query], mode: str, model, tok, redactor=None,
                    max_new_tokens: int = 96, attempts: int = 3) -> tuple[list[Query], list[dict]]:
    """Protected copies of ``queries`` and, per query, the placeholder mapping to restore.

    The instruction gets ``mode``; a context (long, reference text) is only redacted (for
    ``redact`` / ``both``), since rewording it costs much generation for little gain."""
    if mode == "off" or not queries:
        return list(queries), [{} for _ in queries]
    ins = protect_batch([q.instruction for q in queries], mode, model=model, tok=tok,
                        redactor=redactor, max_new_tokens=max_new_tokens, attempts=attempts)
    ctx_mode = "redact" if mode in ("redact", "both") else "off"
    ctx = protect_batch([q.context for q in queries], ctx_mode, redactor=redactor)
    out, maps = [], []
    for q, i, c in zip(queries, ins, ctx):
        context, mapping = join_placeholders(i.mapping, c.text, c.mapping)
        out.append(replace(q, instruction=i.text, context=context if q.context else q.context))
        maps.append(mapping)
    return out, maps


def _canary_queries(cfg, n: int) -> list[Query]:
    from edgefuse.privacy.canaries import load_canary_prompts

    return [Query(qid=f"pii/{i}", kind="dolly", instruction=p.text, context="", choices=None,
                  answer=None, reference="", category="pii-canary")
            for i, p in enumerate(load_canary_prompts(cfg.data.mirror, n, int(cfg.seed)))]


def device_drafter(cfg, model, tok) -> tuple[DrafterSpec, DraftHead | None]:
    """The drafter this device drafts with (``cloud.decode.drafter`` and its parameters,
    :func:`edgefuse.cloud.decoding.drafter_spec`) and the pruned head it needs: for
    ``pruned_head`` the ``draft_head`` most frequent tokens of the public corpus
    (:func:`edgefuse.cloud.devices.pruned_head`, cached under ``paths.cache_dir``), else None.

    Raises:
        edgefuse.cloud.decoding.DecodeError: an unknown drafter or a bad parameter.
    """
    spec = drafter_spec(cfg.cloud)
    return spec, pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size, cfg.paths.cache_dir)


def device_runtime(cfg, client, node_config) -> tuple[object, object, dict]:
    """What this device decodes on, by its profile (:class:`edgefuse.runtime.DeviceProfile`
    of its federation entry and its own ``node_config``).

    Returns:
        ``(model, runtime, facts)``: the PyTorch model the ``cpu`` / ``gpu`` profiles decode with
        (a float16 CUDA copy for ``gpu`` on a CUDA machine); for ``edge`` an
        :class:`~edgefuse.runtime.OnnxDecoder` of the model with this round's adapter merged
        (:func:`edgefuse.export.export_onnx`, cached by adapter hash), else None; and what to
        report (``profile``, ``runtime``, ``export_s``, ``reused``).

    Raises:
        edgefuse.runtime.ProfileError: an unknown profile, ``gpu`` without CUDA and without
            fallback, ``edge`` without ONNX Runtime or for a model the builder does not build.
    """
    from edgefuse.runtime import DeviceProfile, OnnxDecoder

    profile = DeviceProfile.of(client.entry, node_config)
    model = client.slot["peft"]
    facts = {"profile": profile.profile}
    if profile.profile == "edge":
        from edgefuse.export import export_onnx

        ex = export_onnx(str(client.entry.model), profile.quant, model=model, tok=client.slot["tok"],
                         root=cfg.paths.cache_dir, threads=int(cfg.cloud.threads))
        facts.update(runtime=f"onnxruntime-{profile.quant}", export_s=round(ex.export_s, 2),
                     reused=ex.reused, adapter=ex.adapter)
        return model, OnnxDecoder(ex.folder, threads=int(cfg.cloud.threads)), facts
    device = profile.torch_device()
    if device == "cuda":
        import copy

        model = copy.deepcopy(model).to(device="cuda", dtype=torch.float16).eval()
    facts["runtime"] = f"torch-{device}"
    return model, None, facts


def cloud_vocabulary(cfg, tok):
    """``(fingerprint, cross)`` for a device with tokenizer ``tok`` and the cloud's
    ``cloud.model``: the cloud tokenizer's fingerprint (what the OPEN names) and, where the
    two tokenizers differ, their :class:`~edgefuse.cloud.crossvocab.CrossVocab` (else None).
    The device holds the cloud's tokenizer (public, a few MB), never its weights.

    Raises:
        edgefuse.cloud.crossvocab.VocabError: a tokenizer whose tokens cannot be spelled as bytes.
        edgefuse.models.ModelFetchError: the cloud's tokenizer is not on this device.
    """
    from edgefuse.cloud.crossvocab import CrossVocab
    from edgefuse.models import load_tokenizer

    cloud_tok = load_tokenizer(str(cfg.cloud.model), cfg.paths.cache_dir)
    fingerprint = tokenizer_fingerprint(cloud_tok)
    if fingerprint == tokenizer_fingerprint(tok):
        return fingerprint, None
    return fingerprint, CrossVocab(tok, cloud_tok)


def decode(msg: Message, context: Context, client) -> RecordDict:
    """Run every ``cloud.modes`` mode on the message's queries; reply with the records."""
    from edgefuse.privacy.redact import Redactor

    cfg = client.cfg
    c = cfg.cloud
    conf = msg.content["cloud"]
    queries = [Query.from_dict(q) for q in json.loads(str(conf["queries"]))]
    model, tok = client.slot["peft"], client.slot["tok"]
    mode = client_protection(cfg, client.entry)
    redactor = None
    if mode in ("redact", "both"):
        redactor = Redactor.from_config(cfg)
        if cfg.privacy.redact.get("known_identities", False):  # the identities this device holds
            redactor.remember(watch_canaries(cfg, tok))
    reph = cfg.privacy.rephrase if cfg.get("privacy") else {}
    max_new, attempts = int(reph.get("max_new_tokens", 96)), int(reph.get("attempts", 3))
    sent, maps = protect_queries(queries, mode, model, tok, redactor, max_new, attempts)
    dcfg = decode_config(c, auth=auth_from_config(cfg.get("privacy")))
    spec, head = device_drafter(cfg, model, tok)
    host, port, wan = str(conf["host"]), int(conf["port"]), WanProfile.from_name(str(c.wan))
    home = DeviceHome.of(context.node_config)  # this device's keys, whatever the server says
    keys = {"identity": home.identity(), "trust": home.trust()}
    split = None
    if set(map(str, c.modes)) & set(SPLIT_MODES):  # the target's first and last layers, here
        split = with_corpus_mask(load_split_device(str(c.model), settings_from_config(c.split),
                                                   root=cfg.paths.cache_dir),
                                 cfg.data, int(cfg.seed), cfg.paths.cache_dir)
    dmodel, runtime, facts = device_runtime(cfg, client, context.node_config)
    fingerprint, cross = cloud_vocabulary(cfg, tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(c.threads))
    try:
        records, wall = run_devices(
            dmodel, tok, sent, list(c.modes), dcfg, host, port, wan, int(c.devices),
            fingerprint, max_prompt_tokens=int(c.eval.max_prompt_tokens),
            head=head, drafter=spec, split=split, runtime=runtime, cross=cross, **keys)
        n_live = int(cfg.privacy.probe.get("live_canaries", 0)) if cfg.get("privacy") and cfg.privacy.enabled else 0
        if n_live > 0:  # canaries through the live link: the audit scans these frames
            canaries = _canary_queries(cfg, n_live)
            canary_sent, _ = protect_queries(canaries, mode, model, tok, redactor, max_new, attempts)
            run_devices(dmodel, tok, canary_sent, ["spec_sync"], replace(dcfg, max_new_tokens=4), host, port,
                        wan, 1, fingerprint, max_prompt_tokens=int(c.eval.max_prompt_tokens),
                        head=head, drafter=spec, runtime=runtime, cross=cross, **keys)
    finally:
        torch.set_num_threads(threads)
    by_qid = {q.qid: m for q, m in zip(queries, maps)}
    for r in records:
        if by_qid.get(r.qid):
            r.result.text = restore(r.result.text, by_qid[r.qid])
    return RecordDict({"decoding": ConfigRecord({"records": json.dumps([r.to_dict() for r in records]),
                                                 "wall": json.dumps(wall), "protection": mode,
                                                 "tokenizer": "cross" if cross else "same",
                                                 "runtime": json.dumps(facts)})})
