"""Benchmark Cache-to-Cache against its baselines, per pair, through the real main job.

Runs the main job (``edgefuse run experiment=default``: the federation, then a fuser for
every ordered pair and the C2C evaluation; ``--experiment c2c`` is a larger C2C budget with
one client per architecture) and reports, per (receiver ← sharer)
pair: MMLU accuracy and ROUGE-L of the receiver alone / with the sharer's text (T2T) /
with the sharer's KV cache (C2C) / Co-C2C, latency and bytes per query, fuser size and
training time; per receiver, the several-sharers row. Then it checks the issue's targets
(from the C2C paper's gains):

- C2C MMLU accuracy >= receiver alone + 3 points, and >= T2T;
- C2C latency <= 0.5 x T2T latency.

    python bench/bench_c2c.py                       # the default main job (~70 min here)
    python bench/bench_c2c.py --experiment c2c      # 60 fuser steps, 100 MMLU, 10 Dolly/category (not measured)
    python bench/bench_c2c.py --quick               # smaller fusers/eval budget
    python bench/bench_c2c.py --from-results outputs/<run>/results.json   # summarise a run
    python bench/bench_c2c.py c2c.train.steps=200   # extra Hydra overrides

Writes the JSON to ``--out`` and a PNG beside it (same stem). Accuracy differences on 100
MMLU questions have a standard error of about 5 points: read them with that in mind.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_main import run_experiment  # noqa: E402

from edgefuse.io import atomic_write_json
from edgefuse.results import load_results  # noqa: E402

QUICK = ["federation.num_rounds=1", "c2c.train.steps=10", "c2c.train.examples=80",
         "c2c.eval.mmlu_n=20", "c2c.eval.dolly_per_category=1"]


def _row(rows, receiver, mode, sharers):
    for r in rows:
        if r["receiver"] == receiver and r["mode"] == mode and list(r["sharers"]) == list(sharers):
            return r
    return None


def _binom_se(p: float | None, n: int) -> float | None:
    return None if p is None or not n else math.sqrt(max(p * (1 - p), 1e-12) / n)


def summarise(res: dict) -> dict:
    """Per-pair table and target checks from one run's results.json."""
    rows = res.get("c2c") or []
    fusers = {(f["sharer"], f["receiver"]): f for f in res.get("fusers") or []}
    pairs = []
    for (sharer, receiver), f in sorted(fusers.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        alone = _row(rows, receiver, "alone", [])
        modes = {m: _row(rows, receiver, m, [sharer]) for m in ("t2t", "c2c", "co_c2c")}
        entry = {"receiver": receiver, "sharer": sharer, "fuser_params": f.get("params"),
                 "fuser_bytes": f.get("bytes"), "fuser_train_steps": f.get("train_steps"),
                 "fuser_train_s": f.get("train_seconds"), "fuser_val_loss": f.get("val_loss"),
                 "alone_val_loss": f.get("alone_val_loss")}
        for name, r in {"alone": alone, **modes}.items():
            entry[name] = None if r is None else {k: r.get(k) for k in (
                "n_mmlu", "mmlu_acc", "rougeL", "latency_ms", "latency_ms_mmlu",
                "latency_ms_dolly", "bytes_sent", "error")}
        a, t, c = (entry[k] and entry[k]["mmlu_acc"] for k in ("alone", "t2t", "c2c"))
        lt, lc = (entry[k] and entry[k]["latency_ms"] for k in ("t2t", "c2c"))
        n = (entry["alone"] or {}).get("n_mmlu") or 0
        entry["targets"] = {
            "c2c_minus_alone_points": None if None in (a, c) else 100 * (c - a),
            "c2c_ge_alone_plus_3": None if None in (a, c) else c >= a + 0.03,
            "c2c_minus_t2t_points": None if None in (t, c) else 100 * (c - t),
            "c2c_ge_t2t": None if None in (t, c) else c >= t,
            "c2c_over_t2t_latency": None if None in (lt, lc) or not lt else lc / lt,
            "c2c_latency_le_half_t2t": None if None in (lt, lc) else lc <= 0.5 * lt,
            "mmlu_standard_error_points": None if a is None else 100 * _binom_se(a, n),
        }
        pairs.append(entry)
    multi = [{k: r.get(k) for k in ("receiver", "sharers", "mmlu_acc", "rougeL", "latency_ms", "bytes_sent")}
             for r in rows if r["mode"] == "multi"]
    met = [p["targets"] for p in pairs]

    def share(key):
        vals = [m[key] for m in met if m[key] is not None]
        return f"{sum(vals)}/{len(vals)}" if vals else "n/a"

    return {"pairs": pairs, "multi": multi,
            "targets_met": {k: share(k) for k in ("c2c_ge_alone_plus_3", "c2c_ge_t2t",
                                                  "c2c_latency_le_half_t2t")}}


def plot(report: dict, path: Path) -> None:
    """Per pair: MMLU accuracy (alone / T2T / C2C / Co-C2C) and latency (C2C vs T2T)."""
    from matplotlib.figure import Figure

    pairs = report["summary"]["pairs"]
    fig = Figure(figsize=(max(8, 1.6 * len(pairs)), 7), constrained_layout=True)
    ax1, ax2 = fig.subplots(2, 1)
    labels = [f"{p['receiver'].split('-')[0]}\u2190{p['sharer'].split('-')[0]}" for p in pairs]
    modes = ("alone", "t2t", "c2c", "co_c2c")
    w = 0.8 / len(modes)
    for k, m in enumerate(modes):
        xs = [i + (k - 1.5) * w for i in range(len(pairs))]
        ax1.bar(xs, [((p[m] or {}).get("mmlu_acc") or 0.0) for p in pairs], w, label=m)
        ax2.bar(xs, [((p[m] or {}).get("latency_ms") or 0.0) for p in pairs], w, label=m)
    ax1.axhline(0.25, color="grey", lw=0.8, ls="--", label="chance")
    ax1.set_ylabel("MMLU accuracy")
    ax2.set_ylabel("latency per query (ms)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(pairs)), labels, fontsize=8)
        ax.legend(fontsize=8, ncol=5)
    ax1.set_title(f"C2C vs baselines per pair (receiver \u2190 sharer)\ntargets met: "
                  f"{report['summary']['targets_met']}", fontsize=9)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller fuser and evaluation budget")
    ap.add_argument("--experiment", default="default", help="the experiment to run (default: default)")
    ap.add_argument("--from-results", default=None, help="summarise this results.json instead of running")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_c2c.json"))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    report = {"machine": {"cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                          "python": platform.python_version(), "platform": platform.platform()},
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    if args.from_results:
        results_json = Path(args.from_results)
    else:
        overrides = (QUICK if args.quick else []) + list(args.overrides)
        print(f"[bench] running experiment={args.experiment} ...", flush=True)
        e = run_experiment(args.experiment, out.parent / (out.stem + "_runs"), overrides)
        report.update(wall_s=e["wall_s"], peak_pss_bytes=e["peak_pss_bytes"])
        results_json = Path(e["results_json"])
    res = load_results(results_json)
    report["results_json"] = str(results_json)
    report["seconds"] = res["rounds"][-1]["seconds"] if res.get("rounds") else None
    report["summary"] = summarise(res)
    atomic_write_json(out, report)
    plot(report, out.with_suffix(".png"))
    for p in report["summary"]["pairs"]:
        t = p["targets"]
        print(f"[bench] {p['receiver']:<20} <- {p['sharer']:<20} MMLU alone "
              f"{_pct(p['alone'])} t2t {_pct(p['t2t'])} c2c {_pct(p['c2c'])} co_c2c {_pct(p['co_c2c'])}"
              f"  latency c2c/t2t {_num(t['c2c_over_t2t_latency'])}")
    print(f"[bench] targets met: {report['summary']['targets_met']}; wrote {out}", flush=True)
    return 0


def _pct(row) -> str:
    return "-" if not row or row.get("mmlu_acc") is None else f"{100 * row['mmlu_acc']:.1f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
