"""Benchmark split inference: remote autoregressive, naive split, speculative split and
pipelined speculative decoding side by side at two RTTs.

Starts the cloud LLM service (``edgefuse cloud serve``, its own process) with the target
(Qwen2.5-Coder-1.5B) and a split policy that allows any cut (``split_policy={"allowed":
"any"}``), loads here the device's draft (Qwen2.5-Coder-0.5B with the 32k-token pruned head,
as ``bench/bench_cloud.py``) and the target's device layers (embeddings, the first ``k`` and
the last ``m`` layers, the final norm and the head, cut as
:func:`edgefuse.cloud.decoding.split.load_split_device` cuts them, one load shared by the
cuts; the middle's weights are never read here),
and decodes the same prompts (GSM8K test + held-out public Dolly rows, loaded as the
decoding phase loads them) through real sockets and the encrypted link, one device, greedy:

* per RTT (the WAN presets ``wan80`` then ``wan20``): ``cloud`` (remote autoregressive, one
  VERIFY per token: the unsplit model's output, the reference), then ``split`` and
  ``split_spec`` (pipelined) at each ``k = m`` in ``--kms`` (default 1 1, 2 2, 4 4), then
  ``spec_async``, then ``split_spec`` with its synchronous loop at the default cut (variant
  ``sync``: what the pipelining adds);
* then, at the highest RTT and the default cut (``--default-km``, 2 2): ``split`` with float16
  activations (against the int8 row: what the activation codec costs in agreement), with the
  prefill streamed in blocks of 32 rows (against one MID: the prefill seconds per prompt,
  paired), and with
  a split head (``head_split = D/2``, the ``english`` mask, the whole mask 8-bit and its
  top-64; the ``corpus`` mask, the public corpus's 32k most frequent tokens sent once as a
  bitmap, whole): the head's downlink bytes per token. Its agreement per position, teacher
  forced, is ``bench/bench_split_head.py``'s; here it is the free-running agreement.

Per point: tokens/s, ms/token, round trips, bytes up/down per token (socket bytes, framing
included, prefill excluded; the prefill's own bytes per prompt beside them), acceptance,
agreement with the ``cloud`` tokens of the same prompt at the same RTT
(:func:`edgefuse.cloud.devices.summarize`: mean, n and a bootstrap 95 % interval) and the
service's counters over the point, prefill included (``split_jobs``, ``split_batches``, ``split_bytes_in`` /
``_out``, ``split_head_jobs``, ``split_rebuild_rows``, from the authenticated health probe).
Then the ratios at each RTT (``split_spec / split``, ``split / cloud``, ``split_spec /
cloud``, ``spec_async / split_spec``, ``split_spec`` sync ``/ split``, pipelined / sync;
tokens/s) and the issue's target: ``split_spec`` >= 1.4x ``split`` at 80 ms. A ratio or target whose rows were not measured is ``None``.

    python bench/bench_split.py                      # ~30 min on 2 cores
    python bench/bench_split.py --budget-min 28      # stop cleanly before a point would pass 28 min
    python bench/bench_split.py --resume             # run only the points the JSON lacks
    python bench/bench_split.py --quick              # a 10-layer tiny Qwen2, < 1 min: the pipeline

Both processes run torch with one thread (``--threads``): device and cloud as one core each.
The JSON is written after every point (a killed run keeps what it did; points the budget
left out are listed in ``skipped``). Writes ``bench/results/bench_split.json`` and a PNG
beside it (``--quick``: ``bench_split_quick.*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.app.device import DeviceHome, keys_root  # noqa: E402
from edgefuse.app.phases.decoding import load_queries  # noqa: E402
from edgefuse.cloud import vocab as V  # noqa: E402
from edgefuse.cloud.decoding import DRAFTERS, DecodeConfig, DrafterSpec  # noqa: E402
from edgefuse.cloud.decoding.split import SplitDevice, SplitSettings, session_mask  # noqa: E402
from edgefuse.cloud.decoding.result import DecodeResult  # noqa: E402
from edgefuse.cloud.devices import (Record, agreement, pruned_head, run_devices, summarize, table,  # noqa: E402
                                    with_corpus_mask)
from edgefuse.cloud.link import cloud_health  # noqa: E402
from edgefuse.cloud.service import ServiceStartError, start_service_process, stop_service_process  # noqa: E402
from edgefuse.cloud.target import tokenizer_fingerprint  # noqa: E402
from edgefuse.config import compose, resolve_paths  # noqa: E402
from edgefuse.eval import stats  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.models import ModelFetchError, ModelSpecError, load_model  # noqa: E402
from edgefuse.transport.identity import provision  # noqa: E402
from edgefuse.transport.wan import PRESETS, WanProfile  # noqa: E402

TARGET_SPEC_OVER_SPLIT = 1.4  # the issue: split_spec >= 1.4x split tokens/s at 80 ms
TARGET_RTT = 80.0
COUNTERS = ("split_jobs", "split_batches", "split_head_jobs", "split_mask_jobs", "split_bytes_in",
            "split_bytes_out", "split_sessions_total", "split_refusals", "split_rebuild_rows",
            "jobs", "batches", "bytes_in", "bytes_out")
HEAD_TOPKS = (0, 64)  # the split head's downlink: the whole mask 8-bit, its top-64
HEAD_MASK = "english"
STREAM_BLOCK = 32  # prompt rows per MID of the streamed-prefill row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b", help="the device's draft model")
    p.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rtts", type=float, nargs="+", default=[80.0, 20.0],
                   help="emulated RTTs (ms), in run order; a WAN preset's bandwidth where one "
                        "matches (wan20, wan80: 100 Mbps), else --bandwidth-mbps")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--kms", type=int, nargs="+", default=[1, 1, 2, 2, 4, 4], metavar="K M",
                   help="the cuts as k m pairs (default 1 1 2 2 4 4)")
    p.add_argument("--default-km", type=int, nargs=2, default=[2, 2], metavar=("K", "M"),
                   help="the cut of the float16 and split-head rows (default 2 2)")
    p.add_argument("--no-extras", action="store_true", help="skip the float16 and split-head rows")
    p.add_argument("--gsm8k", type=int, default=2, help="GSM8K test prompts")
    p.add_argument("--dolly", type=int, default=1, help="held-out Dolly prompts per category")
    p.add_argument("--prompts", type=int, default=6,
                   help="keep the first N of the GSM8K + Dolly prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--drafter", default="pruned_head", choices=list(DRAFTERS))
    p.add_argument("--draft-head", type=int, default=32768, help="pruned_head: the head's size N")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-wait-ms", type=float, default=20.0,
                   help="the service's batch wait (one device: nothing to wait for)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget-min", type=float, default=None,
                   help="skip (and list) every point that would end past this many minutes "
                        "from the start, judged by the longest point of its kind so far")
    p.add_argument("--mirror", default=None,
                   help="data mirror (default: $EDGEFUSE_DATA_MIRROR, else ../shared/data, else the hub)")
    p.add_argument("--resume", action="store_true",
                   help="keep the points of the existing --out JSON (same models, prompts and "
                        "length) and run only the ones it lacks")
    p.add_argument("--quick", action="store_true",
                   help="a 10-layer random tiny Qwen2 (target and draft), 1 prompt, 8 tokens")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/bench_split.json; --quick: bench_split_quick.json)")
    args = p.parse_args(argv)
    if len(args.kms) % 2:
        p.error("--kms takes k m pairs")
    args.kms = [(args.kms[i], args.kms[i + 1]) for i in range(0, len(args.kms), 2)]
    args.default_km = tuple(args.default_km)
    if args.quick:
        args.gsm8k, args.dolly, args.prompts, args.max_new_tokens = 1, 1, 1, 8
        args.drafter = "full_head"
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("bench_split_quick.json" if args.quick else "bench_split.json"))
    return args


def tiny_target(folder: Path, n_layers: int = 10) -> str:
    """Save a random-weight ``n_layers`` Qwen2 (hidden 64) with the tiny tokenizer to
    ``folder`` (a model folder both processes load by path); returns its path. The head has
    a row for every id of the tokenizer as loaded back from the folder (which adds Qwen2's
    ``<|endoftext|>``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from edgefuse.models import tiny_tokenizer

    tok = tiny_tokenizer()
    Qwen2Config().save_pretrained(folder)  # the folder's model type decides the tokenizer class
    tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = Qwen2Config(num_hidden_layers=n_layers, vocab_size=len(tok), hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def load_cuts(name: str, kms) -> dict[tuple[int, int], SplitDevice]:
    """One :class:`SplitDevice` per cut ``(k, m)`` of the target ``name``, all sharing one
    partial load of it: the embeddings, the first ``max k`` and last ``max m`` decoder
    layers, the final norm and the head (the other layers' weights are never read), cut by
    :func:`edgefuse.cloud.split.split_model` as
    :func:`edgefuse.cloud.decoding.split.load_split_device` cuts it (which, once per cut,
    would hold the 1.5B's 1.9 GB of embeddings and head three times). Raises ``ValueError``
    for a cut the model cannot take."""
    from edgefuse.cloud import split as S
    from edgefuse.models import model_config

    kms = list(dict.fromkeys(tuple(km) for km in kms))
    L = int(model_config(name).num_hidden_layers)
    big_k, big_m = max(k for k, _ in kms), max(m for _, m in kms)
    model, tok = load_model(name, layers=sorted(set(range(big_k)) | set(range(L - big_m, L))))
    model.requires_grad_(False)
    fp, D = tokenizer_fingerprint(tok), int(model.config.hidden_size)
    out = {}
    for k, m in kms:
        settings = SplitSettings(k=k, m=m)
        settings.spec(L, D)
        out[(k, m)] = SplitDevice(S.free_unused(S.split_model(model, k, m, middle=False), "device"),
                                  settings, tok, fp)
    return out


def wan_for(rtt: float, bandwidth_mbps: float) -> tuple[WanProfile, str | None]:
    """The WAN preset of this RTT if one exists (``wan20``, ``wan80``), else a profile of
    ``rtt`` ms and ``bandwidth_mbps``; with the preset's name (or None)."""
    for name, prof in PRESETS.items():
        if prof.rtt_ms == rtt and name.startswith("wan"):
            return prof, name
    return WanProfile(rtt_ms=rtt, bandwidth_mbps=bandwidth_mbps), None


def plan(args) -> list[dict]:
    """The points in run order: ``{"rtt_ms", "mode", "km", "variant", "settings"}``
    (``settings``: None for the unsplit modes, else :class:`SplitSettings` fields beyond the
    cut; ``head_split: "half"`` = D / 2; ``decode``, where present: :class:`DecodeConfig`
    fields of the point)."""
    out = []
    hi = max(args.rtts)
    dk, dm = args.default_km
    for rtt in args.rtts:
        out.append(dict(rtt_ms=rtt, mode="cloud", km=None, variant="main", settings=None))
        for k, m in args.kms:
            for mode in ("split", "split_spec"):
                out.append(dict(rtt_ms=rtt, mode=mode, km=(k, m), variant="main", settings={}))
        out.append(dict(rtt_ms=rtt, mode="spec_async", km=None, variant="main", settings=None))
        # the control of the pipelining: split_spec's synchronous loop at the default cut
        out.append(dict(rtt_ms=rtt, mode="split_spec", km=(dk, dm), variant="sync", settings={},
                        decode={"split_pipeline": False}))
    if not args.no_extras:  # after every main row: a budget leaves these out first
        out.append(dict(rtt_ms=hi, mode="split", km=(dk, dm), variant="act_float16",
                        settings={"act": "float16"}))
        # streamed prefill (block j+1's front while block j is in flight) against one MID
        out.append(dict(rtt_ms=hi, mode="split", km=(dk, dm), variant=f"stream{STREAM_BLOCK}",
                        settings={"stream_block": STREAM_BLOCK}))
        for topk in HEAD_TOPKS:
            out.append(dict(rtt_ms=hi, mode="split", km=(dk, dm),
                            variant=f"head_{HEAD_MASK}_{'whole' if topk == 0 else f'top{topk}'}",
                            settings={"head_split": "half", "mask": HEAD_MASK, "head_topk": topk}))
        # the public corpus's 32k most frequent tokens, sent once as an explicit mask
        out.append(dict(rtt_ms=hi, mode="split", km=(dk, dm), variant="head_corpus_whole",
                        settings={"head_split": "half", "mask": "corpus", "head_topk": 0}))
    return out


def _label(p: dict) -> str:
    km = "" if p["km"] is None else f" k{p['km'][0]} m{p['km'][1]}"
    return f"{p['mode']}{km} {p['variant']} @ {p['rtt_ms']:g} ms"


def _counters(host: str, port: int, token: str) -> dict:
    h = cloud_health(host, port, timeout_s=10.0, token=token)
    return {k: h.get(k) for k in COUNTERS}


def _diff(after: dict, before: dict) -> dict:
    return {k: (after[k] - (before.get(k) or 0)) if isinstance(after.get(k), (int, float)) else after.get(k)
            for k in COUNTERS}


def _find(rows: list[dict], rtt: float, mode: str, km=None, variant: str = "main") -> dict | None:
    for r in rows:
        if r["rtt_ms"] == rtt and r["mode"] == mode and r.get("km") == (list(km) if km else None) \
                and r.get("variant", "main") == variant:
            return r
    return None


def ratios(rows: list[dict], rtts: list[float], kms: list[tuple[int, int]]) -> dict:
    """tokens/s ratios per RTT and cut, each None unless both rows were measured without an
    edge-only fallback."""
    def q(a, b):  # a row with an edge-only fallback measured something else: no ratio
        if not a or not b or a["fallbacks"] or b["fallbacks"] or not b["tokens_per_s"]:
            return None
        return a["tokens_per_s"] / b["tokens_per_s"]

    out = {}
    for rtt in rtts:
        cloud, sa = _find(rows, rtt, "cloud"), _find(rows, rtt, "spec_async")
        for km in kms:
            sp, ss = _find(rows, rtt, "split", km), _find(rows, rtt, "split_spec", km)
            sync = _find(rows, rtt, "split_spec", km, "sync")
            out[f"{rtt:g}ms k{km[0]} m{km[1]}"] = {
                "rtt_ms": rtt, "km": list(km),
                "split_spec_over_split": q(ss, sp), "split_over_cloud": q(sp, cloud),
                "split_spec_over_cloud": q(ss, cloud), "spec_async_over_split_spec": q(sa, ss),
                "split_spec_sync_over_split": q(sync, sp), "pipelined_over_sync": q(ss, sync)}
    return out


def paired_speedups(records: list[dict], rtts: list[float], kms) -> dict:
    """Per RTT and cut, ``split_spec / split`` tokens/s prompt by prompt (the same prompts):
    the geometric mean of the per-prompt ratios with a bootstrap 95 % interval (over the
    log ratios), and n. A prompt either mode ended in an edge-only fallback is left out."""
    import math

    out = {}
    for rtt in rtts:
        for km in kms:
            tps = {}
            for mode in ("split", "split_spec"):
                tps[mode] = {r["qid"]: r["tokens_per_s"] for r in records
                             if r["rtt_ms"] == rtt and r["mode"] == mode and r.get("km") == list(km)
                             and r.get("variant", "main") == "main" and not r.get("fallback")
                             and r.get("tokens_per_s")}
            common = sorted(set(tps["split"]) & set(tps["split_spec"]))
            if not common:
                continue
            est = stats.bootstrap_mean_interval([math.log(tps["split_spec"][q] / tps["split"][q]) for q in common])
            out[f"{rtt:g}ms k{km[0]} m{km[1]}"] = {
                "rtt_ms": rtt, "km": list(km), "n": len(common),
                "split_spec_over_split_geomean": math.exp(est.value),
                "ci95_low": math.exp(est.low), "ci95_high": math.exp(est.high)}
    return out


def check_targets(ratio: dict, kms, default_km) -> dict:
    """The issue's target per cut: split_spec / split >= 1.4 at 80 ms (``met`` None where
    a row is missing); ``headline`` is the default cut's."""
    out = {}
    for km in kms:
        v = (ratio.get(f"{TARGET_RTT:g}ms k{km[0]} m{km[1]}") or {}).get("split_spec_over_split")
        out[f"split_spec_over_split_at_{TARGET_RTT:g}ms_k{km[0]}_m{km[1]}"] = {
            "value": v, "target": TARGET_SPEC_OVER_SPLIT,
            "met": None if v is None else bool(v >= TARGET_SPEC_OVER_SPLIT)}
    key = f"split_spec_over_split_at_{TARGET_RTT:g}ms_k{default_km[0]}_m{default_km[1]}"
    if key in out:
        out["headline"] = {**out[key], "name": key}
    return out


def act_agreement(records: list[dict], rtt: float, km) -> dict | None:
    """float16 vs int8 activations at one cut: per-prompt agreement of the float16 ``split``
    tokens with the int8 ``split`` tokens (bootstrap 95 % interval), None if either is missing."""
    km = list(km)
    pick = {}
    for v in ("main", "act_float16"):
        pick[v] = {r["qid"]: r["tokens"] for r in records if r["rtt_ms"] == rtt and r["mode"] == "split"
                   and r.get("km") == km and r.get("variant") == v}
    common = sorted(set(pick["main"]) & set(pick["act_float16"]))
    if not common:
        return None
    est = stats.bootstrap_mean_interval([agreement(pick["act_float16"][q], pick["main"][q]) for q in common])
    return {"rtt_ms": rtt, "km": km, **est.to_dict("float16_vs_int8_agreement")}


def stream_prefill(records: list[dict], rtt: float, km) -> dict | None:
    """Streamed against one-MID prefill at one cut (``split`` rows): per prompt, the prefill
    seconds of each and their paired difference (stream − one MID, bootstrap 95 %
    interval); None if either row is missing."""
    km = list(km)
    pick = {}
    for v in ("main", f"stream{STREAM_BLOCK}"):
        pick[v] = {r["qid"]: r["prefill_s"] for r in records if r["rtt_ms"] == rtt and r["mode"] == "split"
                   and r.get("km") == km and r.get("variant") == v}
    common = sorted(set(pick["main"]) & set(pick[f"stream{STREAM_BLOCK}"]))
    if not common:
        return None
    one, streamed = [pick["main"][q] for q in common], [pick[f"stream{STREAM_BLOCK}"][q] for q in common]
    return {"rtt_ms": rtt, "km": km, "stream_block": STREAM_BLOCK, "n": len(common),
            "one_mid_s": one, "streamed_s": streamed,
            "one_mid_mean_s": sum(one) / len(one), "streamed_mean_s": sum(streamed) / len(streamed),
            **stats.paired_difference(streamed, one).to_dict("streamed_minus_one_mid_s")}


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour, new_figure, save_png

    rows = [r for r in result["rows"] if r.get("variant", "main") == "main"]
    rtts = sorted({r["rtt_ms"] for r in rows})
    names = []
    for r in rows:
        n = r["mode"] if r.get("km") is None else f"{r['mode']} k{r['km'][0]}m{r['km'][1]}"
        if n not in names:
            names.append(n)

    def val(name, rtt, key):
        for r in rows:
            n = r["mode"] if r.get("km") is None else f"{r['mode']} k{r['km'][0]}m{r['km'][1]}"
            if n == name and r["rtt_ms"] == rtt:
                return r.get(key)
        return None

    fig = new_figure(figsize=(17, 4.2))
    panels = (("tokens_per_s", "tokens/s (1 device)", False), ("round_trips_per_token", "round trips / token", False),
              ("bytes_up_per_token", "bytes up / token", True), ("bytes_down_per_token", "bytes down / token", True),
              ("agreement_with_target", "agreement with cloud (95 % CI)", False))
    width = 0.8 / max(len(rtts), 1)
    for j, (key, title, log) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), j + 1)
        for k, rtt in enumerate(rtts):
            xs = [i + (k - (len(rtts) - 1) / 2) * width for i in range(len(names))]
            vals = [val(n, rtt, key) or 0.0 for n in names]
            err = None
            if key == "agreement_with_target":
                lo = [max(v - (val(n, rtt, "agreement_ci95_low") or v), 0) for n, v in zip(names, vals)]
                hi = [max((val(n, rtt, "agreement_ci95_high") or v) - v, 0) for n, v in zip(names, vals)]
                err = [lo, hi]
            ax.bar(xs, vals, width=width, yerr=err, label=f"RTT {rtt:g} ms", color=colour(k, len(rtts) + 1))
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize="x-small")
    t = result.get("targets", {}).get("headline") or {}
    fig.suptitle(f"split inference: {result['target_model']} cut on the device, {result['edge_model']} drafts "
                 f"(split_spec / split at {TARGET_RTT:g} ms, default cut: "
                 f"{'-' if t.get('value') is None else format(t['value'], '.2f')}x, target "
                 f"{TARGET_SPEC_OVER_SPLIT}x)", fontsize=10)
    return save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spec = DrafterSpec(args.drafter, args.draft_head)
    except ValueError as e:
        print(f"bench_split: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    t_start, load0 = time.perf_counter(), list(os.getloadavg())
    deadline = None if args.budget_min is None else t_start + 60 * args.budget_min
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=args.mirror)
    cfg.cloud.eval.gsm8k_n, cfg.cloud.eval.dolly_per_category = args.gsm8k, args.dolly
    queries = load_queries(cfg)
    if args.prompts:
        queries = queries[:args.prompts]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_name(out.stem + "_service.log")
    names = ("tiny (10 layers)",) * 2 if args.quick else (args.edge_model, args.target_model)  # as recorded
    tmp = None
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="bench-split-"))
        args.target_model = args.edge_model = tiny_target(tmp / "tiny-qwen2-10")
    provision(keys_root(), 1)
    home = DeviceHome.of({"partition-id": 0})
    device_keys = [(home.identity(), home.trust())]
    points = plan(args)
    rows, records, skipped, errors = [], [], [], []
    if args.resume and out.is_file():
        import json

        old = json.loads(out.read_text())
        same = {"prompts": [q.qid for q in queries], "max_new_tokens": args.max_new_tokens,
                "edge_model": names[0], "target_model": names[1], "drafter": spec.name}
        differ = [k for k, v in same.items() if old.get(k) != v]
        if differ:
            print(f"bench_split: --resume: {out} was run with another {', '.join(differ)}", file=sys.stderr)
            return 2
        rows, records = list(old.get("rows", [])), list(old.get("records", []))
    durations: dict[tuple[str, bool], float] = {}  # the longest point of each kind so far (s)
    result = {}

    def write(final: bool = False) -> None:
        ratio = ratios(rows, args.rtts, args.kms)
        hi = max(args.rtts)
        head_rows = [r for r in rows if r.get("variant", "").startswith("head_")]
        result.update({
            "edge_model": names[0], "target_model": names[1],
            "quick": args.quick, "threads": args.threads, "devices": 1, "greedy": True,
            "drafter": spec.name, "draft_head": spec.head_size if spec.name == "pruned_head" else None,
            "prompts": [q.qid for q in queries], "max_new_tokens": args.max_new_tokens,
            "rtts_ms": args.rtts, "kms": [list(km) for km in args.kms], "default_km": list(args.default_km),
            "split_policy": {"allowed": "any"}, "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms,
            "rows": rows, "ratios": ratio, "targets": check_targets(ratio, args.kms, args.default_km),
            "act_agreement": act_agreement(records, hi, args.default_km),
            "stream_prefill": stream_prefill(records, hi, args.default_km),
            "paired_speedups": paired_speedups(records, args.rtts, args.kms),
            "split_head": {
                "mask": HEAD_MASK, "head_split": head_rows[0]["split_head_split"] if head_rows else None,
                "rows": [{k: r.get(k) for k in ("variant", "split", "bytes_down_per_token", "bytes_up_per_token",
                                                "codec_bytes_per_token", "full_8bit_logits_bytes_per_token",
                                                "agreement_with_target", "agreement_n",
                                                "tokens_per_s")} for r in head_rows],
                "agreement_per_position": "bench/bench_split_head.py (teacher forced, Wilson intervals)"},
            "skipped": skipped, "errors": errors, "records": records,
            "complete": final and not skipped and not errors,
            "wall_seconds": time.perf_counter() - t_start,
            "load_avg_start": load0, "load_avg_now": list(os.getloadavg()),  # other work on the machine
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "ram_gb": psutil.virtual_memory().total / 2**30, "torch": torch.__version__},
            "command": "python bench/bench_split.py " + " ".join(sys.argv[1:] if argv is None else argv),
        })
        atomic_write_json(out, result)

    proc = None
    try:
        try:
            proc, port = start_service_process(args.target_model, max_batch=args.max_batch,
                                               max_wait_ms=args.max_wait_ms, threads=args.threads,
                                               log_path=log_path, timeout_s=900,
                                               split_policy={"allowed": "any"})
            model, tok = load_model(args.edge_model)
            head = (pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size)
                    if spec.name == "pruned_head" else None)
            cuts = load_cuts(args.target_model, args.kms + [args.default_km])  # the device's target layers
        except (ServiceStartError, ModelSpecError, ModelFetchError, OSError, ValueError) as e:
            print(f"bench_split: {type(e).__name__}: {' | '.join(str(e).splitlines()[:3])}", file=sys.stderr)
            return 1
        fp = tokenizer_fingerprint(tok)
        dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, timeout_s=600)
        # (Record, rtt): the cloud references of later points (a resumed run's too)
        done = [(Record(r["qid"], r["kind"], r["mode"], r["device"], DecodeResult.from_dict(r), r["reference"]),
                 r["rtt_ms"]) for r in records if r["mode"] == "cloud"]
        for r in rows:
            kind = (r["mode"], r.get("variant", "main").startswith("head_"))
            durations[kind] = max(durations.get(kind, 0.0), r.get("point_wall_s") or 0.0)

        def split_device(km: tuple[int, int], extra: dict) -> SplitDevice:
            base = cuts[km]
            extra = dict(extra)
            if extra.get("head_split") == "half":  # the split head: D / 2 columns on each side
                extra["head_split"] = base.parts.hidden_size // 2
            # the cut's parts are shared by its variants
            return with_corpus_mask(SplitDevice(base.parts, SplitSettings(k=km[0], m=km[1], **extra), base.tok,
                                                base.fingerprint), cfg.data, int(cfg.seed))

        for p in points:
            name = _label(p)
            if _find(rows, p["rtt_ms"], p["mode"], p["km"], p["variant"]):
                continue  # kept from the resumed run
            kind = (p["mode"], p["variant"].startswith("head_"))  # a split head adds a round trip
            est = durations.get(kind, max(durations.values(), default=0.0))
            if deadline is not None and time.perf_counter() + est > deadline:
                skipped.append({"point": name, "rtt_ms": p["rtt_ms"], "mode": p["mode"],
                                "km": None if p["km"] is None else list(p["km"]), "variant": p["variant"],
                                "reason": f"budget ({args.budget_min:g} min): about {est:.0f} s needed"})
                print(f"skip {name}: budget", flush=True)
                write()
                continue
            if proc.poll() is not None:
                errors.append({"point": name, "error": f"the service exited ({proc.returncode}); log {log_path}"})
                write()
                break
            wan, preset = wan_for(p["rtt_ms"], args.bandwidth_mbps)
            t0 = time.perf_counter()
            try:
                split = split_device(p["km"], p["settings"]) if p["settings"] is not None else None
                before = _counters("127.0.0.1", port, proc.health_token)
                pcfg = dataclasses.replace(dcfg, **p.get("decode", {}))
                recs, wall = run_devices(model, tok, queries, [p["mode"]], pcfg, "127.0.0.1", port, wan, 1, fp,
                                         head=head, drafter=spec, device_keys=device_keys, split=split)
                service = _diff(_counters("127.0.0.1", port, proc.health_token), before)
            except Exception as exc:  # one failed point is recorded; the others still run
                errors.append({"point": name, "error": f"{type(exc).__name__}: {exc}"})
                print(f"error {name}: {type(exc).__name__}: {exc}", flush=True)
                write()
                continue
            dt = time.perf_counter() - t0
            durations[kind] = max(durations.get(kind, 0.0), dt)
            km = None if p["km"] is None else list(p["km"])
            ref = [] if p["mode"] == "cloud" else \
                [r for r in done if r[1] == p["rtt_ms"] and r[0].mode == "cloud"]
            got = summarize([r[0] for r in ref] + recs, wall, tok, p["rtt_ms"], 1, greedy=True)
            row = next(r for r in got if r["mode"] == p["mode"])
            row.update({
                "km": km, "variant": p["variant"], "wan": preset, "bandwidth_mbps": wan.bandwidth_mbps,
                "point_wall_s": dt, "service": service,
                "prefill_bytes_up_per_prompt": sum(r.result.prefill_bytes_up for r in recs) / len(recs),
                "prefill_bytes_down_per_prompt": sum(r.result.prefill_bytes_down for r in recs) / len(recs),
                "prefill_s_per_prompt": sum(r.result.prefill_s for r in recs) / len(recs),
                "prefill_s": [r.result.prefill_s for r in recs],
            })
            if split is not None and split.settings.head_split is not None:
                size = int(session_mask(split.settings, split.tok, split.parts.vocab_size, split.mask_ids).size)
                d = V.downlink_per_token(size, split.settings.head_topk, split.parts.vocab_size)
                row.update({"split_head_split": split.settings.head_split, "split_mask_size": size,
                            "codec_bytes_per_token": d["bytes"], "full_8bit_logits_bytes_per_token": d["full_bytes"]})
            rows.append(row)
            done.extend((r, p["rtt_ms"]) for r in recs)
            records.extend({**r.to_dict(), "rtt_ms": p["rtt_ms"], "km": km, "variant": p["variant"]} for r in recs)
            print(f"{name} ({dt:.0f} s):\n{table([row])}", flush=True)
            write()
    finally:
        if proc is not None:
            stop_service_process(proc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    write(final=True)
    png = plot(result, out.with_suffix(".png")) if rows else None
    print("\nratios (tokens/s):")
    for k, v in result["ratios"].items():
        cells = "  ".join(f"{n} {'-' if x is None else format(x, '.2f')}" for n, x in v.items()
                          if n not in ("rtt_ms", "km"))
        print(f"  {k:<16} {cells}")
    print("targets:")
    for k, v in result["targets"].items():
        print(f"  {k:<40} {v['value']!s:<22} target {v['target']}  "
              f"{'met' if v['met'] else 'MISSED' if v['met'] is False else '-'}")
    if result.get("act_agreement"):
        a = result["act_agreement"]
        print(f"float16 vs int8 (split, k{a['km'][0]} m{a['km'][1]}): agreement {a['float16_vs_int8_agreement']}")
    if result.get("stream_prefill"):
        a = result["stream_prefill"]
        print(f"prefill (split, k{a['km'][0]} m{a['km'][1]}): one MID {a['one_mid_mean_s']:.2f} s, streamed in "
              f"blocks of {a['stream_block']} {a['streamed_mean_s']:.2f} s per prompt (n = {a['n']})")
    if skipped or errors:
        print(f"skipped {len(skipped)} point(s), {len(errors)} error(s): see the JSON")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
