"""Benchmark the cloud target's two backends on the same requests: embedded (the model in the
service's process) against vLLM (a vLLM server in its own process and virtual environment,
``cloud.backend: vllm``).

For each backend the service starts in its own process, a device (``--edge-model``) decodes
the same prompts (GSM8K test + held-out public Dolly) in ``cloud`` and ``spec_async`` at an
emulated RTT, and the rows record tokens/s, round trips and bytes per token and whether the
output equals the embedded cloud-only output; ``ratios`` compare vLLM with embedded prompt by
prompt (geometric mean, bootstrap 95 % interval). Each process runs one torch / OpenMP thread.

    python bench/bench_vllm.py --vllm-python .venv-vllm/bin/python     # scripts/vllm_env.sh
    python bench/bench_vllm.py --vllm-python ... --quick                # 1 prompt, 8 tokens

Writes ``bench/results/bench_vllm.json`` and a PNG beside it (after each backend: a killed
run keeps what it measured).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.app.device import DeviceHome, keys_root  # noqa: E402
from edgefuse.cloud.decoding import DecodeConfig, DrafterSpec  # noqa: E402
from edgefuse.cloud.devices import agreement, pruned_head, run_devices, summarize, table  # noqa: E402
from edgefuse.cloud.service import start_service_process, stop_service_process  # noqa: E402
from edgefuse.cloud.target import tokenizer_fingerprint  # noqa: E402
from edgefuse.cloud.vllm_target import vllm_python_ok  # noqa: E402
from edgefuse.config import compose, resolve_paths  # noqa: E402
from edgefuse.eval import stats  # noqa: E402
from edgefuse.eval.queries import dolly_eval_queries, load_gsm8k  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.models import load_model  # noqa: E402
from edgefuse.transport.identity import provision  # noqa: E402
from edgefuse.transport.wan import WanProfile  # noqa: E402

MODES = ["cloud", "spec_async"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's virtual environment")
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rtt", type=float, default=80.0)
    p.add_argument("--gsm8k", type=int, default=2)
    p.add_argument("--dolly-max", type=int, default=2, help="held-out Dolly prompts (the first N)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mirror", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_vllm.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.gsm8k, args.dolly_max, args.max_new_tokens = 1, 0, 8
    return args


def ratios(records: list[dict]) -> dict:
    """vLLM over embedded tokens/s per mode, prompt by prompt (geometric mean, bootstrap 95 %)."""
    out = {}
    for mode in MODES:
        tps = {b: {r["qid"]: r["tokens_per_s"] for r in records if r["backend"] == b and r["mode"] == mode
                   and r.get("tokens_per_s") and not r.get("fallback")} for b in ("embedded", "vllm")}
        common = sorted(set(tps["embedded"]) & set(tps["vllm"]))
        if common:
            est = stats.bootstrap_mean_interval([math.log(tps["vllm"][q] / tps["embedded"][q]) for q in common])
            out[mode] = {"n": len(common), "vllm_over_embedded": math.exp(est.value),
                         "ci95_low": math.exp(est.low), "ci95_high": math.exp(est.high)}
    return out


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour, new_figure, save_png

    fig = new_figure(figsize=(7, 3.4))
    ax = fig.add_subplot(1, 1, 1)
    for k, b in enumerate(("embedded", "vllm")):
        vals = [next((r["tokens_per_s"] for r in result["rows"] if r["backend"] == b and r["mode"] == m), 0.0)
                for m in MODES]
        ax.bar([i + (k - 0.5) * 0.4 for i in range(len(MODES))], vals, width=0.4, label=b, color=colour(k, 3))
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_ylabel("tokens/s (1 device)")
    ax.legend(fontsize="small")
    ax.set_title(f"{result['target_model']} on each backend, {result['edge_model']} drafts, "
                 f"RTT {result['rtt_ms']:g} ms", fontsize=9)
    return save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = vllm_python_ok(args.vllm_python)
    if why:
        print(f"bench_vllm: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=args.mirror)
    queries = load_gsm8k(cfg.data.mirror, args.gsm8k, int(cfg.seed)) if args.gsm8k else []
    queries += dolly_eval_queries(cfg.data, int(cfg.seed), 1)[:args.dolly_max]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    provision(keys_root(), 1)
    home = DeviceHome.of({"partition-id": 0})
    model, tok = load_model(args.edge_model)
    spec = DrafterSpec("pruned_head", 32768)
    head = pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size)
    dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, timeout_s=600)
    wan = WanProfile(rtt_ms=args.rtt, bandwidth_mbps=100.0)
    rows, records = [], []
    result = {"edge_model": args.edge_model, "target_model": args.target_model, "rtt_ms": args.rtt,
              "threads": args.threads, "prompts": [q.qid for q in queries], "max_new_tokens": args.max_new_tokens,
              "rows": rows, "records": records,
              "command": "python bench/bench_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    t0 = time.perf_counter()
    for backend in ("embedded", "vllm"):
        kw = {"backend": "vllm", "vllm_python": args.vllm_python} if backend == "vllm" else {}
        t_start = time.perf_counter()
        proc, port = start_service_process(args.target_model, threads=args.threads, timeout_s=1800,
                                           log_path=out.with_name(f"bench_vllm_{backend}.log"), **kw)
        start_s = time.perf_counter() - t_start
        try:
            recs, wall = run_devices(model, tok, queries, MODES, dcfg, "127.0.0.1", port, wan, 1,
                                     tokenizer_fingerprint(tok), head=head, drafter=spec,
                                     identity=home.identity(), trust=home.trust())
        finally:
            stop_service_process(proc)
        got = summarize(recs, wall, tok, args.rtt, 1, greedy=True, device_model=args.edge_model)
        for r in got:
            r.update(backend=backend, service_start_s=start_s)
        print(f"\n{backend}:\n{table(got)}", flush=True)
        rows.extend(got)
        records.extend({**r.to_dict(), "backend": backend} for r in recs)
        ref = {r["qid"]: r["tokens"] for r in records if r["backend"] == "embedded" and r["mode"] == "cloud"}
        for r in got:  # the same output as the embedded cloud-only run, prompt by prompt
            mine = [x for x in records if x["backend"] == backend and x["mode"] == r["mode"] and x["qid"] in ref]
            r["agreement_with_embedded_cloud"] = (sum(agreement(x["tokens"], ref[x["qid"]]) for x in mine)
                                                  / len(mine)) if mine else None
        result.update(ratios=ratios(records), wall_seconds=time.perf_counter() - t0)
        atomic_write_json(out, result)
    png = plot(result, out.with_suffix(".png"))
    for mode, r in result["ratios"].items():
        print(f"  {mode:<12} vLLM / embedded {r['vllm_over_embedded']:.2f}x [{r['ci95_low']:.2f}, "
              f"{r['ci95_high']:.2f}] (n={r['n']})")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
