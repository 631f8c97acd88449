"""Benchmark edge–cloud collaborative decoding: every device model against one cloud, RTT and
tenancy sweeps.

Starts the cloud LLM service (``edgefuse cloud serve``, its own process) with the target
(Qwen2.5-Coder-1.5B) and decodes the same prompts (GSM8K test + held-out public Dolly)
through real sockets and the encrypted link:

1. ``modes``: per RTT (20 and 80 ms, 100 Mbps), the cloud alone once (``cloud``: one target
   token per round trip; its output is the reference), then per device model (SmolLM2-135M
   and Gemma-3-270M decode across tokenizers, Qwen2.5-Coder-0.5B shares the cloud's) the
   other modes (``--modes``) with one device, γ adaptive; rows carry ``device_model`` and
   ``tokenizer`` (same | cross). Per device and RTT the speculative modes' tokens/s are also
   compared with ``cloud`` prompt by prompt (``per_prompt``: the geometric mean of the
   ratios with a bootstrap 95 % interval, and the worst prompt);
2. ``devices``: the speculative mode (``--scale-mode``) and cloud-only with 1, 2, 4 and 8
   concurrent devices at the highest RTT, each device **its own process** (``--scale-model``
   loaded in each, started together once all are loaded); aggregate tokens/s = all devices'
   tokens over the wall time from the start to the last device's end (rows ``sweep: devices``).

Then it checks the targets: cross-tokenizer ``spec_async`` >= 1.3x cloud-only at 80 ms for at
least one cross-tokenizer device with identical output, speculative >= 0.95x cloud-only on
every prompt, 8-device aggregate >= 3x one device, downlink <= 1 KB per token.

    python bench/bench_cloud.py                 # ~90 min here
    python bench/bench_cloud.py --parts devices # rerun the device sweep, keep the other rows
    python bench/bench_cloud.py --quick         # 1 prompt, 12 tokens, devices 1 and 2

Every process runs torch with one thread (``--threads``): a device and the cloud are
emulated as one core each of this 2-core machine, pinned (the cloud's process to the first
core, every device process to the second, which the sweep's devices share; ``--no-pin``
leaves placement to the OS). Writes ``bench/results/bench_cloud.json`` (``modes`` rows as in the main job's
``decoding``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.cloud.decoding import DRAFTERS, MODES, DecodeConfig, DecodeResult, DrafterSpec  # noqa: E402
from edgefuse.app.device import DeviceHome, keys_root  # noqa: E402
from edgefuse.cloud.crossvocab import CrossVocab  # noqa: E402
from edgefuse.cloud.devices import Record, pruned_head, run_devices, summarize, table  # noqa: E402
from edgefuse.transport.identity import provision  # noqa: E402
from edgefuse.cloud.service import start_service_process, stop_service_process  # noqa: E402
from edgefuse.cloud.target import tokenizer_fingerprint  # noqa: E402
from edgefuse.config import compose, resolve_paths  # noqa: E402
from edgefuse.eval import stats  # noqa: E402
from edgefuse.models import load_model, load_tokenizer  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.transport.wan import WanProfile  # noqa: E402
from edgefuse.eval.queries import Query, dolly_eval_queries, load_gsm8k  # noqa: E402

TARGETS = {
    "round_trips_per_token_max": 0.3,
    "bytes_down_per_token_max": 1000.0,
    "cross_spec_over_cloud_min": 1.3,
    "spec_worst_prompt_over_cloud_min": 0.95,
    "aggregate_8_over_1_min": 3.0,
}
SPEC = ("spec_sync", "spec_async")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge-models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
    p.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rtts", type=float, nargs="+", default=[20.0, 80.0], help="emulated RTTs (ms)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=["spec_sync", "spec_async", "fusion_static"],
                   choices=[m for m in MODES if m != "cloud"], help="per device model (cloud runs once per RTT)")
    p.add_argument("--scale-mode", default="spec_async", choices=MODES)
    p.add_argument("--scale-model", default="smollm2-135m", help="the device model of the device sweep")
    p.add_argument("--scale-prompts", type=int, default=2, help="prompts per device in the device sweep")
    p.add_argument("--gsm8k", type=int, default=2, help="GSM8K test prompts")
    p.add_argument("--dolly", type=int, default=1, help="held-out Dolly prompts per category (8 categories)")
    p.add_argument("--dolly-max", type=int, default=None, help="keep only the first N Dolly prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=None, help="fixed γ (default: adaptive)")
    p.add_argument("--no-gamma0", action="store_true", help="the adaptive γ never drops to 0 (the control)")
    p.add_argument("--drafter", default="pruned_head", choices=list(DRAFTERS),
                   help="what drafts for the speculative modes (default pruned_head)")
    p.add_argument("--draft-head", type=int, default=32768, help="pruned_head: the head's size N")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-wait-ms", type=float, default=100.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-pin", action="store_true", help="do not pin the cloud and the devices to cores")
    p.add_argument("--mirror", default=None,
                   help="data mirror (default: $EDGEFUSE_DATA_MIRROR, else ../shared/data, else the hub)")
    p.add_argument("--parts", nargs="+", default=["modes", "devices"], choices=["modes", "devices"],
                   help="what to run; a part left out keeps its rows from the existing --out JSON")
    p.add_argument("--cloud-repeat", action="store_true",
                   help="the control: run the cloud alone again after every device model, so a "
                        "prompt's ratio can be read against timing noise (JSON noise_floor)")
    p.add_argument("--paired-cloud", action="store_true",
                   help="run the cloud alone again just before every device model after the first, "
                        "and compare that model's modes with it (the machine's speed drifts over a run)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_cloud.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one device process of the sweep
    args = p.parse_args(argv)
    if args.quick:
        args.gsm8k, args.dolly, args.max_new_tokens, args.devices, args.scale_prompts = 1, 0, 12, [1, 2], 1
        args.rtts = args.rtts[-1:]
    return args


def _row(rows, mode, rtt, devices, sweep=None, model=None):
    for r in rows:
        if r["mode"] == mode and r["rtt_ms"] == rtt and r["devices"] == devices and r.get("sweep") == sweep \
                and (model is None or r.get("device_model") in (model, None)):
            return r
    return None


def _kept(out: Path, parts: list[str]) -> tuple[list[dict], list[dict]]:
    """Rows and records of the parts not rerun, from the previous result at ``out``."""
    if set(parts) == {"modes", "devices"} or not out.is_file():
        return [], []
    old = json.loads(out.read_text())
    keep_sweep = "devices" not in parts
    return ([r for r in old.get("modes", []) if (r.get("sweep") == "devices") == keep_sweep],
            [r for r in old.get("records", []) if (r.get("sweep") == "devices") == keep_sweep])


def per_prompt(records: list[dict], rtt: float, model: str | None, mode: str,
               sweep: str | None = None) -> dict | None:
    """``mode`` of ``model`` over ``cloud`` tokens/s prompt by prompt at ``rtt`` (same prompts):
    geometric mean of the ratios, bootstrap 95 % interval over their logs, the worst prompt's
    ratio, n. The cloud's run is the one next to this model's (``--paired-cloud``) where there
    is one. Prompts where either ended in a fallback are left out. ``sweep="repeat"`` with
    mode ``cloud``: the control, the cloud alone run again over its first run (how far one
    prompt's ratio moves by timing noise alone)."""
    def tps(m, dm, tag=None):
        return {r["qid"]: r["tokens_per_s"] for r in records
                if r["rtt_ms"] == rtt and r["mode"] == m and r.get("sweep") == tag
                and (dm is None or r.get("device_model") == dm) and not r.get("fallback") and r.get("tokens_per_s")}
    mine = tps(mode, model, sweep)
    cloud = (tps("cloud", model, "paired") if model and sweep is None else {}) or tps("cloud", None)
    common = sorted(set(mine) & set(cloud))
    if not common:
        return None
    logs = [math.log(mine[q] / cloud[q]) for q in common]
    est = stats.bootstrap_mean_interval(logs)
    return {"device_model": model, "mode": mode, "rtt_ms": rtt, "n": len(common),
            "geomean": math.exp(est.value), "ci95_low": math.exp(est.low), "ci95_high": math.exp(est.high),
            "worst": math.exp(min(logs)), "worst_qid": common[logs.index(min(logs))]}


def check_targets(rows: list[dict], ratios: list[dict], rtts: list[float], devices: list[int],
                  scale_mode: str) -> dict:
    """The targets, each ``{"value", "target", "met"}`` (``met`` None if not measured)."""
    hi = max(rtts)
    out = {}

    def put(name, value, target, ok):
        out[name] = {"value": value, "target": target, "met": None if value is None else bool(ok(value))}

    links = [r for r in rows if r["mode"] != "edge" and r.get("sweep") != "devices"]
    put("bytes_down_per_token_worst", max((r["bytes_down_per_token"] for r in links), default=None),
        TARGETS["bytes_down_per_token_max"], lambda v: v <= TARGETS["bytes_down_per_token_max"])
    c = _row(rows, "cloud", hi, 1)
    cross = [r for r in rows if r["mode"] == "spec_async" and r["rtt_ms"] == hi and r.get("sweep") is None
             and r.get("tokenizer") == "cross" and r.get("identical_to_target")]
    best = max(cross, key=lambda r: r["tokens_per_s"], default=None)
    put(f"cross_spec_async_over_cloud_at_{hi:g}ms", best["tokens_per_s"] / c["tokens_per_s"] if best and c else None,
        TARGETS["cross_spec_over_cloud_min"], lambda v: v >= TARGETS["cross_spec_over_cloud_min"])
    if best:
        out[f"cross_spec_async_over_cloud_at_{hi:g}ms"]["device_model"] = best["device_model"]
    worst = min((r["worst"] for r in ratios if r["mode"] in SPEC), default=None)
    put("spec_worst_prompt_over_cloud", worst, TARGETS["spec_worst_prompt_over_cloud_min"],
        lambda v: v >= TARGETS["spec_worst_prompt_over_cloud_min"])
    specs = [r for r in rows if r["mode"] in SPEC and r.get("sweep") is None]
    ident = all(r.get("identical_to_target") for r in specs) if specs else None
    out["spec_identical_to_target"] = {"value": ident, "target": True, "met": ident}
    one, many = (_row(rows, scale_mode, hi, d, "devices") for d in (1, max(devices)))
    put(f"aggregate_{max(devices)}_over_1", (many["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"])
        if one and many and max(devices) > 1 else None,
        TARGETS["aggregate_8_over_1_min"], lambda v: v >= TARGETS["aggregate_8_over_1_min"])
    return out


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour as _colour, new_figure as _new_figure, save_png as _save_png

    rows = [r for r in result["modes"] if r.get("sweep") is None]
    rtts = sorted({r["rtt_ms"] for r in rows})
    labels = sorted({(r.get("device_model") or "cloud", r["mode"]) for r in rows},
                    key=lambda x: (x[0] != "cloud", x[0], MODES.index(x[1])))
    fig = _new_figure(figsize=(17, 4.2))
    panels = (("tokens_per_s", "tokens/s (1 device)"), ("round_trips_per_token", "round trips / token"),
              ("bytes_down_per_token", "downlink bytes / token"))
    width = 0.8 / max(len(rtts), 1)
    for j, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, 4, j + 1)
        for k, rtt in enumerate(rtts):
            vals = []
            for dm, mode in labels:
                r = next((x for x in rows if x["rtt_ms"] == rtt and x["mode"] == mode
                          and (x.get("device_model") or "cloud") == dm), {})
                vals.append(r.get(key) or 0.0)
            ax.bar([i + (k - (len(rtts) - 1) / 2) * width for i in range(len(labels))], vals, width=width,
                   label=f"RTT {rtt:g} ms", color=_colour(k, len(rtts) + 1))
        ax.set_xticks(range(len(labels)), [f"{d.split('-')[0]} {m}" for d, m in labels], rotation=40,
                      ha="right", fontsize=6)
        ax.set_title(title, fontsize=9)
        if key == "bytes_down_per_token":
            ax.axhline(TARGETS["bytes_down_per_token_max"], ls="--", c="grey", lw=0.8)
            ax.set_yscale("log")
        ax.legend(fontsize="x-small")
    ax = fig.add_subplot(1, 4, 4)
    sweep = [r for r in result["modes"] if r.get("sweep") == "devices"]
    for k, m in enumerate(sorted({r["mode"] for r in sweep})):
        pts = sorted((r["devices"], r["aggregate_tokens_per_s"]) for r in sweep if r["mode"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, color=_colour(k, 3))
    ax.set_xlabel("concurrent devices (one process each)")
    ax.set_title("aggregate tokens/s", fontsize=9)
    ax.legend(fontsize="x-small")
    fig.suptitle(f"devices draft / fuse, {result['target_model']} verifies (torch threads {result['threads']} each)",
                 fontsize=10)
    return _save_png(fig, path)


def pin(pid: int, cpus: set[int]) -> bool:
    """Pin every thread of process ``pid`` (0: this one) to ``cpus``; False where the OS
    cannot (no ``sched_setaffinity``) or the machine has fewer cores."""
    if not hasattr(os, "sched_setaffinity") or max(cpus) >= (os.cpu_count() or 1):
        return False
    pid = pid or os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile
    return True


CLOUD_CPUS, DEVICE_CPUS = {0}, {1}


def _device(name: str, cfg, spec: DrafterSpec, target: str):
    """(model, tok, head, fingerprint, cross) of device model ``name`` against ``target``."""
    model, tok = load_model(name)
    head = pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size)
    ctok = load_tokenizer(target)
    fp = tokenizer_fingerprint(ctok)
    cross = None if fp == tokenizer_fingerprint(tok) else CrossVocab(tok, ctok)
    return model, tok, head, fp, cross


def worker(path: str) -> int:
    """One device process of the sweep: load, say ready, wait for go, decode, write records."""
    job = json.loads(Path(path).read_text())
    torch.set_num_threads(int(job["threads"]))
    if job.get("pin"):
        pin(0, DEVICE_CPUS)
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=job["mirror"])
    spec = DrafterSpec(job["drafter"], job["draft_head"])
    model, tok, head, fp, cross = _device(job["model"], cfg, spec, job["target"])
    home = DeviceHome.of({"partition-id": job["device"]})
    qs = [Query.from_dict(q) for q in job["queries"]]
    dcfg = DecodeConfig(max_new_tokens=job["max_new_tokens"], gamma=job["gamma"], timeout_s=600,
                        gamma0_fallback=job["gamma0"])
    wan = WanProfile(rtt_ms=job["rtt"], bandwidth_mbps=job["bandwidth"], seed=job["device"])
    Path(job["ready"]).write_text("ready")
    while not Path(job["go"]).exists():
        time.sleep(0.005)
    t0 = time.time()
    recs, _ = run_devices(model, tok, qs, [job["mode"]], dcfg, "127.0.0.1", job["port"], wan, 1, fp,
                          head=head, drafter=spec, identity=home.identity(), trust=home.trust(), cross=cross)
    atomic_write_json(job["out"], {"start": t0, "end": time.time(),
                                   "records": [r.to_dict() for r in recs]})
    return 0


def process_sweep(args, port: int, d: int, mode: str, qs: list, tmp: Path) -> tuple[list[Record], float]:
    """``d`` device processes decoding ``qs`` (dealt round-robin) in ``mode`` at once; returns
    their records and the wall time from the common start to the last end (s)."""
    procs, jobs = [], []
    go = tmp / f"go-{mode}-{d}"
    go.unlink(missing_ok=True)
    for i in range(d):
        job = {"model": args.scale_model, "target": args.target_model, "port": port, "device": i,
               "mode": mode, "queries": [q.to_dict() for q in qs[i::d]], "threads": args.threads,
               "mirror": args.mirror, "drafter": args.drafter, "draft_head": args.draft_head,
               "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "gamma0": not args.no_gamma0,
               "rtt": max(args.rtts), "bandwidth": args.bandwidth_mbps, "pin": not args.no_pin,
               "ready": str(tmp / f"ready-{mode}-{d}-{i}"), "go": str(go), "out": str(tmp / f"out-{mode}-{d}-{i}.json")}
        for k in ("ready", "out"):
            Path(job[k]).unlink(missing_ok=True)
        jp = tmp / f"job-{mode}-{d}-{i}.json"
        jp.write_text(json.dumps(job))
        jobs.append(job)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(jp)]))
    deadline = time.time() + 900
    while not all(Path(j["ready"]).exists() for j in jobs):
        if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"a device process of the {d}-device sweep failed to start")
        time.sleep(0.05)
    go.write_text("go")
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a device process of the {d}-device sweep exited with {p.returncode}")
    outs = [json.loads(Path(j["out"]).read_text()) for j in jobs]
    records = []
    for i, o in enumerate(outs):
        for r in o["records"]:
            records.append(Record(r["qid"], r["kind"], r["mode"], i, DecodeResult.from_dict(r), r["reference"]))
    return records, max(o["end"] for o in outs) - min(o["start"] for o in outs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    try:
        spec = DrafterSpec(args.drafter, args.draft_head)
    except ValueError as e:
        print(f"bench_cloud: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=args.mirror)  # --mirror, else as every entry point resolves it
    args.mirror = str(cfg.data.mirror) if cfg.data.mirror is not None else None
    queries = []
    if args.gsm8k:
        queries += load_gsm8k(cfg.data.mirror, args.gsm8k, int(cfg.seed))
    if args.dolly:
        queries += dolly_eval_queries(cfg.data, int(cfg.seed), args.dolly)[:args.dolly_max]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + "_work")
    tmp.mkdir(exist_ok=True)
    log_path = out.with_name(out.stem + "_service.log")
    t_start = time.perf_counter()
    provision(keys_root(), max(args.devices))  # every device a provisioned one (the cloud authorizes it)
    homes = [DeviceHome.of({"partition-id": d}) for d in range(max(args.devices))]
    device_keys = [(h.identity(), h.trust()) for h in homes]
    proc, port = start_service_process(args.target_model, max_batch=args.max_batch,
                                       max_wait_ms=args.max_wait_ms, threads=args.threads,
                                       log_path=log_path, timeout_s=900)
    pinned = not args.no_pin and pin(proc.pid, CLOUD_CPUS) and pin(0, DEVICE_CPUS)
    rows, records_all = _kept(out, args.parts)
    dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma, timeout_s=600,
                        gamma0_fallback=not args.no_gamma0)
    ctok = load_tokenizer(args.target_model)

    def progress(mode, done, total):
        print(f"  {mode:<16} {done}/{total}", end="\r", flush=True)

    def keep(got, recs, rtt, devices, tag=None, model=None):
        for r in got:
            r["gamma"], r["sweep"] = dcfg.gamma, tag
        print(f"\n{model or ''} RTT {rtt:g} ms, {devices} device(s):\n{table(got)}", flush=True)
        rows.extend(got)
        records_all.extend({**r.to_dict(), "rtt_ms": rtt, "devices": devices, "sweep": tag,
                            "device_model": model, "gamma": dcfg.gamma} for r in recs)

    def cloud_again(model, tok, head, fp, cross, wan, rtt, tag, device_model):
        """The cloud alone over every query once more; its records kept under ``tag``."""
        rep, _ = run_devices(model, tok, queries, ["cloud"], dcfg, "127.0.0.1", port, wan, 1, fp,
                             head=head, progress=progress, drafter=spec,
                             device_keys=device_keys[:1], cross=cross)
        records_all.extend({**r.to_dict(), "rtt_ms": rtt, "devices": 1, "sweep": tag,
                            "device_model": device_model, "gamma": dcfg.gamma} for r in rep)

    def save():
        result = {
            "edge_models": args.edge_models, "target_model": args.target_model, "threads": args.threads,
            "prompts": [q.qid for q in queries], "max_new_tokens": args.max_new_tokens,
            "gamma": args.gamma, "gamma0_fallback": not args.no_gamma0, "drafter": spec.name,
            "draft_head": spec.head_size, "bandwidth_mbps": args.bandwidth_mbps,
            "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "scale_model": args.scale_model,
            "pinned": {"cloud": sorted(CLOUD_CPUS), "devices": sorted(DEVICE_CPUS)} if pinned else None,
            "modes": rows, "records": records_all,
            "wall_seconds": time.perf_counter() - t_start,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "ram_gb": psutil.virtual_memory().total / 2**30, "torch": torch.__version__},
            "command": "python bench/bench_cloud.py " + " ".join(sys.argv[1:] if argv is None else argv),
        }
        ratios = [x for x in (per_prompt(records_all, rtt, m, mode) for rtt in args.rtts
                              for m in args.edge_models for mode in args.modes if mode in SPEC) if x]
        result["per_prompt"] = ratios
        result["noise_floor"] = [x for x in (per_prompt(records_all, rtt, None, "cloud", sweep="repeat")
                                             for rtt in args.rtts) if x]
        result["targets"] = check_targets(rows, ratios, args.rtts, args.devices, args.scale_mode)
        atomic_write_json(out, result)  # after every part: a killed run keeps what it measured
        return result

    try:
        warm = False
        if "modes" in args.parts:
            for rtt in args.rtts:
                wan = WanProfile(rtt_ms=rtt, bandwidth_mbps=args.bandwidth_mbps)
                cloud_recs = None
                for m in args.edge_models:
                    model, tok, head, fp, cross = _device(m, cfg, spec, args.target_model)
                    if cloud_recs is None and not warm:  # a first request pays one-off costs: not measured
                        run_devices(model, tok, queries[:1], ["cloud"], dcfg, "127.0.0.1", port, wan, 1, fp,
                                    head=head, drafter=spec, device_keys=device_keys[:1], cross=cross)
                        warm = True
                    elif args.paired_cloud:  # the cloud alone again, next to this model's modes in time
                        cloud_again(model, tok, head, fp, cross, wan, rtt, "paired", m)
                    if cloud_recs is None:  # the cloud alone: once per RTT, its output the reference
                        cloud_recs, wall_c = run_devices(model, tok, queries, ["cloud"], dcfg, "127.0.0.1", port,
                                                         wan, 1, fp, head=head, progress=progress, drafter=spec,
                                                         device_keys=device_keys[:1], cross=cross)
                        keep(summarize(cloud_recs, wall_c, tok, rtt, 1, greedy=True, cloud_tok=ctok),
                             cloud_recs, rtt, 1)
                    recs, wall = run_devices(model, tok, queries, list(args.modes), dcfg, "127.0.0.1", port,
                                             wan, 1, fp, head=head, progress=progress, drafter=spec,
                                             device_keys=device_keys[:1], cross=cross)
                    got = [r for r in summarize(recs + cloud_recs, {**wall, **wall_c}, tok, rtt, 1,
                                                greedy=True, device_model=m, cloud_tok=ctok)
                           if r["mode"] != "cloud"]
                    keep(got, recs, rtt, 1, model=m)
                    save()
                    del model, head
                    gc.collect()
                if args.cloud_repeat:  # the control: the cloud alone again, after every model
                    model, tok, head, fp, cross = _device(args.edge_models[0], cfg, spec, args.target_model)
                    cloud_again(model, tok, head, fp, cross, wan, rtt, "repeat", None)
                    save()
                    del model, head
                    gc.collect()
        for d in args.devices if "devices" in args.parts else []:
            qs = [queries[i % len(queries)] for i in range(args.scale_prompts * d)]
            for mode in ("cloud", args.scale_mode):
                recs, wall_s = process_sweep(args, port, d, mode, qs, tmp)
                tok = load_tokenizer(args.scale_model)
                got = summarize(recs, {mode: wall_s}, tok, max(args.rtts), d, greedy=True,
                                device_model=args.scale_model, cloud_tok=ctok)
                keep(got, recs, max(args.rtts), d, tag="devices", model=args.scale_model)
            save()
    finally:
        stop_service_process(proc)
    result = save()
    png = plot(result, out.with_suffix(".png"))
    print("\ntargets:")
    for k, v in result["targets"].items():
        print(f"  {k:<40} {v['value']!s:<24} target {v['target']!s:<8} "
              f"{'met' if v['met'] else 'MISSED' if v['met'] is False else '-'}")
    for r in result["per_prompt"] + result["noise_floor"]:
        print(f"  {r['device_model'] or 'cloud again':<20} {r['mode']:<10} {r['rtt_ms']:g} ms: {r['geomean']:.2f}x "
              f"[{r['ci95_low']:.2f}, {r['ci95_high']:.2f}] worst {r['worst']:.2f}x (n={r['n']})")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
