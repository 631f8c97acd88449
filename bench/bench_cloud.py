"""Benchmark edge–cloud collaborative decoding: every mode side by side, RTT and tenancy sweeps.

Starts the cloud LLM service (``edgefuse cloud serve``, its own process) with the target
(Qwen2.5-Coder-1.5B), loads the edge draft (Qwen2.5-Coder-0.5B) here, and decodes the same
prompts (GSM8K test + held-out public Dolly) through real sockets and the encrypted link:

1. every mode (edge, cloud, spec_sync, spec_async, fusion_static, fusion_adaptive) with one
   device at emulated RTT 20 ms and 80 ms (100 Mbps), γ adaptive; then the speculative
   modes with a fixed γ (``--fixed-gammas``, default 8) at 80 ms (rows with ``sweep: gamma``);
2. the speculative mode (``--scale-mode``) and cloud-only with 1, 2, 4 and 8 concurrent
   devices at 80 ms (rows with ``sweep: devices``): simulated devices share this process's
   draft model (memory allows one) and run their forward passes batched
   (:class:`edgefuse.cloud.decoding.DraftBatcher`, standing in for devices computing in parallel);
   what counts is concurrent sessions at the service, which batches their verifications.

Then it checks the issue's targets: round trips per token <= 0.3 (speculative), downlink
<= 1 KB per token (all link modes), async >= 1.25x sync at 80 ms, speculative >= 1.3x
cloud-only tokens/s at 80 ms with identical output, and 8-device aggregate >= 3x one device.

    python bench/bench_cloud.py                 # ~40 min here
    python bench/bench_cloud.py --parts devices # rerun the device sweep, keep the other rows
    python bench/bench_cloud.py --quick         # 2 prompts, 16 tokens, devices 1 and 2

Both processes run torch with one thread (``--threads``): the device and the cloud are
emulated as one core each of this 2-core machine. Writes ``bench/results/bench_cloud.json``
(``modes`` rows as in the main job's ``decoding``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.cloud.decoding import DRAFTERS, MODES, DecodeConfig, DrafterSpec  # noqa: E402
from edgefuse.app.device import DeviceHome, keys_root  # noqa: E402
from edgefuse.cloud.devices import pruned_head, run_devices, summarize, table  # noqa: E402
from edgefuse.transport.identity import provision  # noqa: E402
from edgefuse.cloud.service import start_service_process, stop_service_process  # noqa: E402
from edgefuse.cloud.target import tokenizer_fingerprint  # noqa: E402
from edgefuse.config import compose, resolve_paths  # noqa: E402
from edgefuse.models import load_model  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.transport.wan import WanProfile  # noqa: E402
from edgefuse.eval.queries import dolly_eval_queries, load_gsm8k  # noqa: E402

TARGETS = {
    "round_trips_per_token_max": 0.3,
    "bytes_down_per_token_max": 1000.0,
    "async_over_sync_min": 1.25,
    "spec_over_cloud_min": 1.3,
    "aggregate_8_over_1_min": 3.0,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rtts", type=float, nargs="+", default=[20.0, 80.0], help="emulated RTTs (ms)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--scale-mode", default="spec_async", choices=MODES)
    p.add_argument("--scale-prompts", type=int, default=2, help="prompts per device in the device sweep")
    p.add_argument("--fixed-gammas", type=int, nargs="*", default=[8],
                   help="also run the speculative modes with these fixed γ at the highest RTT")
    p.add_argument("--gsm8k", type=int, default=2, help="GSM8K test prompts")
    p.add_argument("--dolly", type=int, default=1, help="held-out Dolly prompts per category (8 categories)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=None, help="fixed γ (default: adaptive)")
    p.add_argument("--drafter", default="pruned_head", choices=list(DRAFTERS),
                   help="what drafts for the speculative modes (default pruned_head)")
    p.add_argument("--draft-head", type=int, default=32768, help="pruned_head: the head's size N")
    p.add_argument("--shallow-layers", type=int, default=12, help="shallow: the first L decoder layers")
    p.add_argument("--ngram-n", type=int, nargs=2, default=[3, 1], metavar=("MAX_N", "MIN_N"),
                   help="ngram: the longest and shortest suffix prompt lookup matches")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-wait-ms", type=float, default=100.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mirror", default=None,
                   help="data mirror (default: $EDGEFUSE_DATA_MIRROR, else ../shared/data, else the hub)")
    p.add_argument("--parts", nargs="+", default=["modes", "devices"], choices=["modes", "devices"],
                   help="what to run; a part left out keeps its rows from the existing --out JSON")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_cloud.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.gsm8k, args.dolly, args.max_new_tokens, args.devices, args.scale_prompts = 1, 0, 16, [1, 2], 1
        args.fixed_gammas = []
    return args


def _row(rows, mode, rtt, devices, sweep=None):
    for r in rows:
        if r["mode"] == mode and r["rtt_ms"] == rtt and r["devices"] == devices and r.get("sweep") == sweep:
            return r
    return None


def _kept_rows(out: Path, parts: list[str]) -> tuple[list[dict], list[dict]]:
    """Rows and records of the parts not rerun, from the previous result at ``out``."""
    if set(parts) == {"modes", "devices"} or not out.is_file():
        return [], []
    import json

    old = json.loads(out.read_text())
    keep_sweep = "devices" not in parts  # the "gamma" rows belong to the modes part
    return ([r for r in old.get("modes", []) if (r.get("sweep") == "devices") == keep_sweep],
            [r for r in old.get("records", []) if (r.get("sweep") == "devices") == keep_sweep])


def fill_gamma_agreement(rows: list[dict], records: list[dict]) -> None:
    """Agreement / identity of the fixed-γ rows with the ``cloud`` generations of the same
    prompts at the same RTT (the fixed-γ part runs no ``cloud`` mode of its own)."""
    from edgefuse.cloud.devices import agreement

    for r in rows:
        if r.get("sweep") != "gamma":
            continue
        ref = {x["qid"]: x["tokens"] for x in records
               if x["mode"] == "cloud" and x["rtt_ms"] == r["rtt_ms"] and x["devices"] == 1
               and x.get("sweep") is None}
        mine = [x for x in records if x["mode"] == r["mode"] and x.get("sweep") == "gamma"
                and x.get("gamma") == r["gamma"] and x["qid"] in ref]
        if mine:
            agree = [agreement(x["tokens"], ref[x["qid"]]) for x in mine]
            r["agreement_with_target"] = sum(agree) / len(agree)
            r["identical_to_target"] = all(a == 1.0 for a in agree)


def check_targets(rows: list[dict], rtts: list[float], devices: list[int], scale_mode: str) -> dict:
    """The issue's targets, each ``{"value", "target", "met"}`` (``met`` None if not measured)."""
    hi = max(rtts)
    out = {}

    def put(name, value, target, ok):
        out[name] = {"value": value, "target": target, "met": None if value is None else bool(ok(value))}

    specs = [r for r in rows if r["mode"] in ("spec_sync", "spec_async") and r.get("sweep") is None]
    for name, group in (("round_trips_per_token_adaptive", specs),
                        ("round_trips_per_token_fixed_gamma", [r for r in rows if r.get("sweep") == "gamma"])):
        put(name, min((r["round_trips_per_token"] for r in group), default=None),
            TARGETS["round_trips_per_token_max"], lambda v: v <= TARGETS["round_trips_per_token_max"])
    links = [r for r in rows if r["mode"] != "edge" and r.get("sweep") != "devices"]
    put("bytes_down_per_token_worst", max((r["bytes_down_per_token"] for r in links), default=None),
        TARGETS["bytes_down_per_token_max"], lambda v: v <= TARGETS["bytes_down_per_token_max"])
    a, s, c = (_row(rows, m, hi, 1) for m in ("spec_async", "spec_sync", "cloud"))
    put(f"async_over_sync_at_{hi:g}ms", a["tokens_per_s"] / s["tokens_per_s"] if a and s else None,
        TARGETS["async_over_sync_min"], lambda v: v >= TARGETS["async_over_sync_min"])
    best = max((r for r in (a, s) if r), key=lambda r: r["tokens_per_s"], default=None)
    put(f"spec_over_cloud_at_{hi:g}ms", best["tokens_per_s"] / c["tokens_per_s"] if best and c else None,
        TARGETS["spec_over_cloud_min"], lambda v: v >= TARGETS["spec_over_cloud_min"])
    out["spec_identical_to_target"] = {"value": all(r.get("identical_to_target") for r in specs) if specs else None,
                                       "target": True, "met": all(r.get("identical_to_target") for r in specs) if specs else None}
    one, many = (_row(rows, scale_mode, hi, d, "devices") for d in (1, max(devices)))
    put(f"aggregate_{max(devices)}_over_1", (many["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"])
        if one and many and max(devices) > 1 else None,
        TARGETS["aggregate_8_over_1_min"], lambda v: v >= TARGETS["aggregate_8_over_1_min"])
    return out


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour as _colour, new_figure as _new_figure, save_png as _save_png

    rows = result["modes"]
    rtts = sorted({r["rtt_ms"] for r in rows if r.get("sweep") is None})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig = _new_figure(figsize=(16, 3.8))
    panels = (("tokens_per_s", "tokens/s (1 device)"), ("round_trips_per_token", "round trips / token"),
              ("bytes_down_per_token", "downlink bytes / token"))
    width = 0.8 / max(len(rtts), 1)
    for j, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 4, j + 1)
        for k, rtt in enumerate(rtts):
            vals = [(_row(rows, m, rtt, 1) or {}).get(key) or 0.0 for m in modes]
            ax.bar([i + (k - (len(rtts) - 1) / 2) * width for i in range(len(modes))], vals, width=width,
                   label=f"RTT {rtt:g} ms", color=_colour(k, len(rtts) + 1))
        ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        if key == "bytes_down_per_token":
            ax.axhline(TARGETS["bytes_down_per_token_max"], ls="--", c="grey", lw=0.8)
            ax.set_yscale("log")
        if key == "round_trips_per_token":
            ax.axhline(TARGETS["round_trips_per_token_max"], ls="--", c="grey", lw=0.8)
        ax.legend(fontsize="x-small")
    ax = fig.add_subplot(1, 4, 4)
    hi = max(r["rtt_ms"] for r in rows)
    for k, m in enumerate(sorted({r["mode"] for r in rows if r.get("sweep") == "devices"})):
        pts = sorted((r["devices"], r["aggregate_tokens_per_s"]) for r in rows
                     if r["mode"] == m and r.get("sweep") == "devices")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, color=_colour(k, 3))
    ax.set_xlabel("concurrent devices")
    ax.set_title(f"aggregate tokens/s at {hi:g} ms", fontsize=9)
    ax.legend(fontsize="x-small")
    fig.suptitle(f"{result['edge_model']} drafts, {result['target_model']} verifies "
                 f"(torch threads {result['threads']} each)", fontsize=10)
    return _save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spec = DrafterSpec(args.drafter, args.draft_head, args.shallow_layers, *args.ngram_n)
    except ValueError as e:
        print(f"bench_cloud: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=args.mirror)  # --mirror, else as every entry point resolves it
    queries = []
    if args.gsm8k:
        queries += load_gsm8k(cfg.data.mirror, args.gsm8k, int(cfg.seed))
    if args.dolly:
        queries += dolly_eval_queries(cfg.data, int(cfg.seed), args.dolly)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_name(out.stem + "_service.log")
    t_start = time.perf_counter()
    # every simulated device is a provisioned one (its own identity; the cloud authorizes it)
    provision(keys_root(), max(args.devices))
    homes = [DeviceHome.of({"partition-id": d}) for d in range(max(args.devices))]
    device_keys = [(h.identity(), h.trust()) for h in homes]
    proc, port = start_service_process(args.target_model, max_batch=args.max_batch,
                                       max_wait_ms=args.max_wait_ms, threads=args.threads,
                                       log_path=log_path, timeout_s=900)
    rows, records_all = [], []
    try:
        model, tok = load_model(args.edge_model)
        head = pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size)
        fp = tokenizer_fingerprint(tok)
        dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma, timeout_s=600)

        def progress(mode, done, total):
            print(f"  {mode:<16} {done}/{total}", end="\r", flush=True)

        def sweep(modes, rtt, devices, qs, gamma=None, tag=None):
            wan = WanProfile(rtt_ms=rtt, bandwidth_mbps=args.bandwidth_mbps)
            cfg_ = dcfg if gamma is None else DecodeConfig(max_new_tokens=args.max_new_tokens, gamma=gamma,
                                                           timeout_s=600)
            recs, wall = run_devices(model, tok, qs, modes, cfg_, "127.0.0.1", port, wan, devices, fp,
                                     head=head, progress=progress, drafter=spec,
                                     device_keys=device_keys[:devices])
            got = summarize(recs, wall, tok, rtt, devices, greedy=True)
            for r in got:
                r["gamma"] = cfg_.gamma
                if tag:
                    r["sweep"] = tag
            print(f"\nRTT {rtt:g} ms, {devices} device(s), γ {cfg_.gamma or 'adaptive'}:\n{table(got)}",
                  flush=True)
            rows.extend(got)
            records_all.extend({**r.to_dict(), "rtt_ms": rtt, "devices": devices, "sweep": tag,
                                "gamma": cfg_.gamma} for r in recs)

        kept, kept_records = _kept_rows(out, args.parts)
        rows.extend(kept)
        records_all.extend(kept_records)
        hi = max(args.rtts)
        for rtt in args.rtts if "modes" in args.parts else []:
            sweep(list(args.modes), rtt, 1, queries)
        for g in args.fixed_gammas if "modes" in args.parts else []:
            sweep(["spec_sync", "spec_async"], hi, 1, queries, gamma=g, tag="gamma")
        scale_rows = []
        for d in args.devices if "devices" in args.parts else []:
            # every device decodes --scale-prompts prompts; the 1-device point is rerun alike
            qs = [queries[i % len(queries)] for i in range(args.scale_prompts * d)]
            before = len(rows)
            sweep(["cloud", args.scale_mode], hi, d, qs, tag="devices")
            scale_rows += rows[before:]
    finally:
        stop_service_process(proc)
    if "modes" in args.parts:
        fill_gamma_agreement(rows, records_all)
    targets = check_targets(rows, args.rtts, args.devices, args.scale_mode)
    result = {
        "edge_model": args.edge_model, "target_model": args.target_model, "threads": args.threads,
        "prompts": [q.qid for q in queries], "max_new_tokens": args.max_new_tokens,
        "gamma": args.gamma, "drafter": spec.name, "draft_head": spec.head_size,
        "shallow_layers": spec.shallow_layers if spec.name == "shallow" else None,
        "ngram_n": [spec.ngram_n, spec.ngram_min_n] if spec.name == "ngram" else None,
        "bandwidth_mbps": args.bandwidth_mbps,
        "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms,
        "modes": rows, "targets": targets, "records": records_all,
        "wall_seconds": time.perf_counter() - t_start,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "ram_gb": psutil.virtual_memory().total / 2**30, "torch": torch.__version__},
        "command": "python bench/bench_cloud.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    atomic_write_json(out, result)
    png = plot(result, out.with_suffix(".png"))
    print("\ntargets:")
    for k, v in targets.items():
        print(f"  {k:<32} {v['value']!s:<24} target {v['target']!s:<8} {'met' if v['met'] else 'MISSED' if v['met'] is False else '-'}")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
