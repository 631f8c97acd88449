"""Evaluate the decoding modes side by side: concurrent device sessions, quality and cost.

Shared by the main job (the device's ``query.decode`` handler, :mod:`edgefuse.app.handlers.decoding`),
``bench/bench_cloud.py`` and ``edgefuse cloud generate``. One *device* here is one session
at the cloud service: its own :class:`~edgefuse.cloud.link.CloudLink` and its own KV cache
(:class:`~edgefuse.cloud.decoding.EdgeLM`) and drafter; simulated devices in one process share the edge model's
weights, which is what memory allows. For each mode, all devices decode their share of the
prompts at the same time, so the service batches their requests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from edgefuse.transport.wan import WanProfile
from edgefuse.eval import stats
from edgefuse.eval.queries import Query, gsm8k_final, prompt_split, rouge_l

from edgefuse.cloud.crossvocab import encode
from edgefuse.cloud.target import tokenizer_fingerprint
from edgefuse.cloud.decoding import (MODES, DecodeConfig, DecodeResult, Decoder, DraftBatcher, DrafterSpec,
                                     EdgeLM, OnnxEdgeLM, drafter_factory)

log = logging.getLogger(__name__)
FULL_HEAD_ONLY = ("pruned_head", "shallow")  # drafters an ONNX or GPU device replaces by full_head

ROW_FIELDS = ("device_model", "tokenizer", "mode", "rtt_ms", "devices", "tokens_per_s", "aggregate_tokens_per_s",
              "round_trips_per_token", "bytes_down_per_token", "bytes_up_per_token",
              "acceptance_rate", "identical_to_target", "agreement_with_target", "ms_per_token",
              "gsm8k_exact_match", "rouge_l", "new_tokens", "deadline_misses", "fallbacks",
              "edge_weight_mean", "prompts", "drafter", "split",
              # n and 95 % intervals (edgefuse.eval.stats); *_vs_cloud: paired on the same prompts
              "agreement_n", "agreement_ci95_low", "agreement_ci95_high",
              "gsm8k_n", "gsm8k_ci95_low", "gsm8k_ci95_high",
              "rouge_l_n", "rouge_l_ci95_low", "rouge_l_ci95_high",
              "rouge_l_vs_cloud", "rouge_l_vs_cloud_n", "rouge_l_vs_cloud_ci95_low",
              "rouge_l_vs_cloud_ci95_high")


def prompt_ids(query: Query, tok, max_prompt_tokens: int) -> list[int]:
    """The chat-templated prompt ids of ``query`` (as the C2C evaluation builds them)."""
    prefill, last = prompt_split(query, tok, max_prompt_tokens)
    return prefill + [last]


def public_corpus(data_cfg, seed: int, tok) -> list[str]:
    """The corpus of the frequency-pruned draft head: the chat-templated prompt + response of
    every row of the public split's ``draft_corpus`` slice
    (:func:`edgefuse.eval.splits.public_slices`; no client holds these rows, and no
    evaluation query, fuser or attacker uses them; GSM8K is not in it)."""
    from edgefuse.data import format_example
    from edgefuse.eval.splits import public_slices

    return ["".join(format_example(r, tok)) for r in public_slices(data_cfg, seed).rows("draft_corpus")]


def pruned_head(model, tok, data_cfg, seed: int, n: int, cache_dir=None):
    """A :class:`edgefuse.cloud.decoding.drafters.DraftHead` keeping the ``n`` most frequent tokens of
    :func:`public_corpus` (cached as JSON under ``<cache_dir>/draft_heads``), or None for ``n <= 0``.

    Raises:
        ValueError: the ``draft_corpus`` slice is empty (no rows left in the public split).
    """
    if n <= 0:
        return None
    from edgefuse.cloud.decoding.drafters import DraftHead

    return DraftHead(model, _frequent_ids(tok, data_cfg, seed, n, cache_dir))


def corpus_mask_ids(tok, data_cfg, seed: int, n: int, cache_dir=None) -> np.ndarray:
    """The ids of a split head's ``corpus`` vocabulary mask: the ``n`` most frequent tokens
    of :func:`public_corpus` (the ids a pruned draft head of ``n`` keeps, from the same cache
    file), ``int64``. Raises ``ValueError`` as :func:`pruned_head`."""
    return _frequent_ids(tok, data_cfg, seed, n, cache_dir).numpy()


def with_corpus_mask(split, data_cfg, seed: int, cache_dir=None):
    """``split`` (a :class:`~edgefuse.cloud.decoding.split.SplitDevice`) with the ids of its
    ``corpus`` mask (``settings.mask_size`` tokens, :func:`corpus_mask_ids` over the target's
    tokenizer) when it has one; unchanged otherwise (None stays None)."""
    from edgefuse.cloud.decoding.split import CORPUS_MASK

    if split is not None and split.settings.head_split is not None and split.settings.mask == CORPUS_MASK:
        split.mask_ids = corpus_mask_ids(split.tok, data_cfg, seed, split.settings.mask_size, cache_dir)
    return split


def _frequent_ids(tok, data_cfg, seed: int, n: int, cache_dir=None):
    """The ``n`` most frequent token ids of :func:`public_corpus` (``LongTensor``), cached
    as JSON under ``<cache_dir>/draft_heads``."""
    from edgefuse.models import cache_dir as model_cache

    from edgefuse.cloud.decoding.drafters import frequent_token_ids
    from edgefuse.cloud.target import tokenizer_fingerprint

    path = model_cache(cache_dir) / "draft_heads" / f"{tokenizer_fingerprint(tok)}-{n}.json"
    corpus = public_corpus(data_cfg, seed, tok)
    if not corpus:
        raise ValueError("the draft_corpus slice of the public split is empty: lower the other "
                         "data.public_slices sizes or raise data.public_fraction")
    return frequent_token_ids(tok, corpus, n, cache_path=path)


@dataclass
class Record:
    """One (prompt, mode) generation by one device."""
    qid: str
    kind: str
    mode: str
    device: int
    result: DecodeResult
    reference: str | None

    def to_dict(self) -> dict:
        return {"qid": self.qid, "kind": self.kind, "mode": self.mode, "device": self.device,
                "reference": self.reference, "tokens": list(self.result.tokens),
                **self.result.summary()}


def run_devices(model, tok, queries: list[Query], modes: list[str], cfg: DecodeConfig,
                host: str | None, port: int | None, wan: WanProfile | None, devices: int,
                fingerprint: str, max_prompt_tokens: int = 256, head=None,
                connect_timeout_s: float = 30.0, progress=None,
                batch_devices: bool = True,
                drafter: DrafterSpec | None = None, identity=None, trust=None,
                device_keys=None, insecure: bool = False, split=None,
                runtime=None, cross=None) -> tuple[list[Record], dict[str, float]]:
    """Decode every query in every mode with ``devices`` concurrent sessions.

    Queries are dealt round-robin to the devices; modes run one after another, each with all
    devices at once. Each device opens one link (``wan`` emulated, seeded per device) and
    keeps it for all modes. ``progress(mode, done, total)`` is called after each generation.
    ``batch_devices``: the simulated devices' forward passes run batched
    (:class:`~edgefuse.cloud.decoding.DraftBatcher`), standing in for devices computing in parallel.
    ``drafter``: what the speculative modes draft with (each device gets its own,
    :func:`~edgefuse.cloud.decoding.drafter_factory`); ``head`` is the pruned head it needs
    (:func:`pruned_head` of ``drafter.head_size``). None: the pruned ``head`` if one is
    given, else the full head.
    ``identity`` / ``trust``: the device's Ed25519 identity and trust store every link
    authenticates with (one real device holding ``devices`` sessions); ``device_keys``: one
    ``(identity, trust)`` per simulated device instead (a sweep of distinct provisioned
    devices); ``insecure``: anonymous links (the benchmark's "auth off" column only).
    ``split``: the target's device layers for ``split`` / ``split_spec``
    (:func:`edgefuse.cloud.decoding.split.load_split_device`; shared by the devices).
    ``runtime``: an :class:`~edgefuse.runtime.OnnxDecoder` the devices run instead of
    ``model`` (the ``edge`` profile; each device an :class:`~edgefuse.cloud.decoding.OnnxEdgeLM`
    over it, unbatched). It has no hidden states, so a ``pruned_head`` or ``shallow`` drafter
    becomes ``full_head`` (logged; the rows name the drafter used); so does a ``model`` on a
    GPU (the ``gpu`` profile), which is not batched either.
    ``cross``: the device's and the cloud's vocabularies when they differ
    (:class:`~edgefuse.cloud.crossvocab.CrossVocab`): the link modes decode on the cloud's ids
    of each prompt (its own chat template) and ``fingerprint`` must be the cloud tokenizer's.

    Returns:
        ``(records, wall_s)``: one :class:`Record` per (query, mode), and the wall time of
        each mode's phase (seconds), for aggregate throughput.

    Raises:
        ValueError: ``devices < 1``, an unknown mode or a drafter that cannot be built (a
            ``pruned_head`` without ``head``, too many ``shallow_layers``);
            ``edgefuse.cloud.link.CloudUnavailable`` when
            a link mode is asked for and the service cannot be reached at all;
        edgefuse.transport.identity.UntrustedPeerError: the cloud is not the pinned one.
    """
    from edgefuse.cloud.link import CloudLink

    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown decoding modes {unknown}; choose from {', '.join(MODES)}")
    need_link = any(m != "edge" for m in modes)
    prompts = [prompt_ids(q, tok, max_prompt_tokens) for q in queries]
    cloud_prompts = [prompt_ids(q, cross.cloud_tok, max_prompt_tokens) for q in queries] \
        if cross is not None else [None] * len(queries)
    # the CPU batcher and the pruned head / shallow views serve a PyTorch model on the CPU only
    plain_cpu = runtime is None and next(model.parameters()).device.type == "cpu"
    batcher = None
    if batch_devices and devices > 1 and plain_cpu:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        batcher = DraftBatcher(model, int(pad or 0))
    if drafter is None:
        drafter = DrafterSpec("pruned_head" if head is not None else "full_head")
    if not plain_cpu and drafter.name in FULL_HEAD_ONLY:
        log.warning("an ONNX Runtime or GPU device drafts with its full head, not %s", drafter.name)
        drafter, head = replace(drafter, name="full_head"), None
    make_drafter = drafter_factory(drafter, head)
    if runtime is not None:
        edges = [OnnxEdgeLM(runtime, tok) for _ in range(devices)]
    else:
        edges = [EdgeLM(model, tok, batcher=batcher) for _ in range(devices)]
    drafters = [make_drafter(e) for e in edges]  # before any link: a bad drafter leaks none
    rtt = wan.rtt_ms if wan is not None else 1.0
    if device_keys is not None and len(device_keys) < devices:
        raise ValueError(f"device_keys has {len(device_keys)} identities for {devices} devices")
    links = []
    records: list[Record] = []
    wall: dict[str, float] = {}
    lock = threading.Lock()
    try:
        for d in range(devices if need_link else 0):
            prof = None if wan is None else WanProfile(wan.rtt_ms, wan.bandwidth_mbps, wan.jitter_ms,
                                                       wan.loss, seed=wan.seed + d)
            ident, tr = device_keys[d] if device_keys is not None else (identity, trust)
            links.append(CloudLink.connect(host, port, wan=prof, timeout_s=connect_timeout_s,
                                           identity=ident, trust=tr, insecure=insecure))
        decoders = [Decoder(e, links[d] if links else None, fingerprint, rtt_ms=rtt, drafter=drafters[d],
                            split=split, cross=cross)
                    for d, e in enumerate(edges)]
        for mode in modes:
            done = [0]
            errors: list[BaseException] = []

            def work(d: int) -> None:
                try:
                    for i in range(d, len(queries), devices):
                        res = decoders[d].generate(mode, prompts[i], cfg, cloud_prompt=cloud_prompts[i])
                        with lock:
                            records.append(Record(queries[i].qid, queries[i].kind, mode, d, res,
                                                  queries[i].reference))
                            done[0] += 1
                            if progress:
                                progress(mode, done[0], len(queries))
                except BaseException as exc:  # surfaced below, with the device named
                    errors.append(RuntimeError(f"device {d}, mode {mode}: {type(exc).__name__}: {exc}"))

            t0 = time.perf_counter()
            threads = [threading.Thread(target=work, args=(d,), daemon=True) for d in range(devices)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall[mode] = time.perf_counter() - t0
            if errors:
                raise errors[0]
    finally:
        for link in links:
            link.close()
    return records, wall


def agreement(a: list[int], b: list[int]) -> float:
    """Position-wise next-token agreement of two generations: equal positions over the
    longer length (1.0 = identical, 0.0 when both are empty is defined as 1.0)."""
    if not a and not b:
        return 1.0
    same = sum(x == y for x, y in zip(a, b))
    return same / max(len(a), len(b))


def _id_space(res: DecodeResult, same_vocab: bool) -> str:
    """Whose ids ``res.tokens`` are: the cloud's (``same``, ``cross``, and ``own`` when the
    device's tokenizer is the cloud's) or the device's."""
    return "device" if res.tokenizer == "own" and not same_vocab else "cloud"


def summarize(records: list[Record], wall: dict[str, float], tok, rtt_ms: float, devices: int,
              greedy: bool, device_model: str | None = None, cloud_tok=None) -> list[dict]:
    """One row per mode (fields :data:`ROW_FIELDS`), ``device_model`` named in each and the
    tokenizer path its generations took (``tokenizer``: own / same / cross,
    :class:`~edgefuse.cloud.decoding.DecodeResult`).

    Per-token figures are totals over all generations divided by generated tokens;
    ``tokens_per_s`` is the mean of the sessions' own rates, ``aggregate_tokens_per_s`` all
    tokens over the mode's wall time. Agreement and identity compare each generation with
    the ``cloud`` mode's on the same prompt (``None`` without a ``cloud`` run;
    ``identical_to_target`` only for greedy decoding; ids in two vocabularies, as a device of
    another tokenizer's ``edge`` against its ``cloud``, are compared on ``cloud_tok``'s ids of
    the two texts, or not at all without it); GSM8K is scored on the text; ``drafter``: the drafter of
    the mode's drafting generations (``spec_sync`` / ``spec_async``; None for the other modes)."""
    by_mode: dict[str, list[Record]] = {}
    for r in records:
        by_mode.setdefault(r.mode, []).append(r)
    target = {r.qid: r.result for r in by_mode.get("cloud", [])}

    same_vocab = cloud_tok is None or tokenizer_fingerprint(tok) == tokenizer_fingerprint(cloud_tok)

    def same_ids(r: Record) -> float | None:
        ref = target[r.qid]
        if _id_space(r.result, same_vocab) == _id_space(ref, same_vocab):
            return agreement(r.result.tokens, ref.tokens)
        if cloud_tok is None:
            return None
        return agreement(encode(cloud_tok, r.result.text), encode(cloud_tok, ref.text))

    cloud_rouge = {r.qid: rouge_l(r.result.text, r.reference or "") for r in by_mode.get("cloud", [])
                   if r.kind == "dolly"}
    rows = []
    for mode, recs in by_mode.items():
        res = [r.result for r in recs]
        toks = sum(len(x.tokens) for x in res)
        n = max(toks, 1)
        drafted = sum(x.drafted for x in res)
        agree_each = [a for a in (same_ids(r) for r in recs if r.qid in target) if a is not None]
        agree = stats.bootstrap_mean_interval(agree_each)
        gsm = stats.proportion([
            gsm8k_final(r.result.text) == r.reference
            for r in recs if r.kind == "gsm8k"])
        rouge = {r.qid: rouge_l(r.result.text, r.reference or "") for r in recs if r.kind == "dolly"}
        rl = stats.bootstrap_mean_interval(list(rouge.values()))
        common = sorted(set(rouge) & set(cloud_rouge)) if mode != "cloud" else []
        vs_cloud = (stats.paired_difference([rouge[q] for q in common], [cloud_rouge[q] for q in common])
                    if common else stats.Estimate(None, 0, None, None))
        weights = [x.edge_weight_mean for x in res if x.edge_weight_mean is not None]
        drafters = sorted({x.drafter for x in res if x.drafter})
        splits = sorted({x.split for x in res if x.split})
        rows.append({
            "device_model": device_model, "tokenizer": ",".join(sorted({x.tokenizer for x in res})),
            "mode": mode, "rtt_ms": rtt_ms, "devices": devices,
            "tokens_per_s": float(np.mean([x.tokens_per_s for x in res])),
            "aggregate_tokens_per_s": toks / wall[mode] if wall.get(mode) else None,
            "round_trips_per_token": sum(x.round_trips for x in res) / n,
            "bytes_down_per_token": sum(x.bytes_down for x in res) / n,
            "bytes_up_per_token": sum(x.bytes_up for x in res) / n,
            "acceptance_rate": (sum(x.accepted for x in res) / drafted) if drafted else None,
            "identical_to_target": (all(a == 1.0 for a in agree_each) if agree_each and greedy else None),
            "agreement_with_target": agree.value,
            "ms_per_token": 1000 * sum(x.decode_s for x in res) / n,
            "gsm8k_exact_match": gsm.value,
            "rouge_l": rl.value,
            "new_tokens": toks,
            "deadline_misses": sum(x.deadline_misses for x in res),
            "fallbacks": sum(x.fallback is not None for x in res),
            "edge_weight_mean": float(np.mean(weights)) if weights else None,
            "prompts": len(recs),
            "drafter": ",".join(drafters) or None,
            "split": ",".join(splits) or None,
            "agreement_n": agree.n, "agreement_ci95_low": agree.low, "agreement_ci95_high": agree.high,
            "gsm8k_n": gsm.n, "gsm8k_ci95_low": gsm.low, "gsm8k_ci95_high": gsm.high,
            "rouge_l_n": rl.n, "rouge_l_ci95_low": rl.low, "rouge_l_ci95_high": rl.high,
            **vs_cloud.to_dict("rouge_l_vs_cloud"),
        })
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(rows, key=lambda r: order.get(r["mode"], 99))


def table(rows: list[dict]) -> str:
    """A fixed-width text table of the main columns (for logs and the bench)."""
    cols = (("mode", "mode", 16, None), ("dev", "devices", 3, "d"), ("tok/s", "tokens_per_s", 7, ".2f"),
            ("ms/tok", "ms_per_token", 7, ".0f"), ("RT/tok", "round_trips_per_token", 6, ".2f"),
            ("B-up/t", "bytes_up_per_token", 7, ".1f"), ("B-dn/t", "bytes_down_per_token", 7, ".1f"),
            ("accept", "acceptance_rate", 6, ".2f"), ("agree", "agreement_with_target", 6, ".2f"),
            ("gsm8k", "gsm8k_exact_match", 6, ".2f"), ("rougeL", "rouge_l", 6, ".3f"))
    lines = [" ".join(f"{h:<{w}}" if f is None else f"{h:>{w}}" for h, _, w, f in cols)]
    for r in rows:
        cells = []
        for _, key, w, f in cols:
            v = r.get(key)
            cells.append(f"{v:<{w}}" if f is None else " " * w if v is None else f"{v:>{w}{f}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)
