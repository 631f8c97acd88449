"""Benchmark the main job: wall time, peak memory (PSS), per-round time split, bytes per round.

Runs ``edgefuse run experiment=<name>`` for each experiment (default: smoke and default)
one after the other in this process's environment, samples the memory (PSS) of every process
of the federation (launcher, SuperLink, simulation, Ray workers) every 0.5 s, and reads
the per-round timings and bytes from each run's results.json.

    python bench/bench_main.py                 # smoke + default (~10 min here, models cached)
    python bench/bench_main.py --quick         # smoke only (< 5 min)
    python bench/bench_main.py --out bench/results/main.json

Writes the JSON to ``--out`` and a PNG beside it (same stem). Figures are compared as
ratios within one run (machines here are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.io import atomic_write_json
from edgefuse.results import load_results  # noqa: E402

# Processes that belong to a federated run (matched against the command line).
FEDERATION_MARKERS = ("flower-superlink", "flwr-simulation", "flwr", "ray::", "raylet",
                      "gcs_server", "edgefuse", "default_worker.py")


def federation_memory() -> int:
    """Summed PSS (bytes) of all processes that look like part of the federation.

    PSS (proportional set size) splits shared pages (torch's libraries, Ray's object store)
    between the processes that map them, so the sum is not inflated the way an RSS sum is.
    """
    total = 0
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and any(m in cmd for m in FEDERATION_MARKERS):
                total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, AttributeError):
            continue
    return total


class PeakSampler(threading.Thread):
    """Samples :func:`federation_memory` every ``interval`` seconds; keeps the peak."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.peak, self._halt = interval, 0, threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.peak = max(self.peak, federation_memory())
            self._halt.wait(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def run_experiment(name: str, out_root: Path, extra: list[str]) -> dict:
    """One main-job run; returns its measured figures.

    Raises:
        RuntimeError: the run failed (its output tail is included).
    """
    out_root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "edgefuse.cli", "run", f"experiment={name}",
           f"outputs.root={out_root}", *extra]
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = sampler.stop()
    runs = sorted(p for p in out_root.iterdir() if (p / "results.json").exists())
    if proc.returncode != 0 or not runs:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    res = load_results(runs[-1] / "results.json")
    rounds = []
    for rd in res["rounds"]:
        ok = [c for c in rd["clients"] if c["status"] == "ok"]
        rounds.append({
            "round": rd["round"],
            "train_phase_s": rd["seconds"]["train"],
            "client_train_s_sum": sum(c.get("train_seconds", 0.0) for c in ok),
            "client_train_s_max": max((c.get("train_seconds", 0.0) for c in ok), default=0.0),
            "client_model_load_s_sum": sum(c.get("load_seconds", 0.0) for c in ok),
            "aggregate_s": rd["seconds"]["aggregate"],
            "evaluate_phase_s": rd["seconds"]["evaluate"],
            "round_s": rd["seconds"]["total"],
            "bytes_up": sum(c["bytes_up"] for c in rd["clients"]),
            "bytes_down": sum(c["bytes_down"] for c in rd["clients"]),
        })
    last = res["rounds"][-1]["clients"]
    return {
        "experiment": name,
        "results_json": str(runs[-1] / "results.json"),
        "clients": len(last),
        "models": sorted({c["model"] for c in last}),
        "wall_s": wall,
        "peak_pss_bytes": peak,
        "rounds": rounds,
        "max_aggregate_s": max(r["aggregate_s"] for r in rounds),
        "final_minus_base_loss": {f"p{c['partition_id']} {c['model']} r{c['lora_rank']}":
                                  (c["eval_loss"] - c["base_eval_loss"])
                                  if c["eval_loss"] is not None and c["base_eval_loss"] is not None
                                  else None for c in last},
    }


def plot(report: dict, path: Path) -> None:
    """Per-round time split (stacked) and bytes per round, one column per experiment."""
    from matplotlib.figure import Figure

    exps = report["experiments"]
    fig = Figure(figsize=(6 * len(exps), 7), constrained_layout=True)
    axes = fig.subplots(2, len(exps), squeeze=False)
    for j, e in enumerate(exps):
        rs = e["rounds"]
        x = [r["round"] for r in rs]
        par = max(1, e.get("parallel_clients", 1))
        comp = [r["client_train_s_sum"] / par for r in rs]
        other = [max(r["train_phase_s"] - c, 0.0) for r, c in zip(rs, comp)]
        agg = [r["aggregate_s"] for r in rs]
        ev = [r["evaluate_phase_s"] for r in rs]
        ax = axes[0][j]
        bottom = [0.0] * len(x)
        for vals, label in ((comp, "client training (per worker)"),
                            (other, "transfer, scheduling, model loads"),
                            (agg, "server aggregation"), (ev, "evaluation")):
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{e['experiment']}: {e['wall_s']:.0f} s wall, "
                     f"peak PSS {e['peak_pss_bytes'] / 2**30:.1f} GiB")
        ax.set_xticks(x)
        ax.set_xlabel("round")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        w = 0.4
        ax.bar([i - w / 2 for i in x], [r["bytes_up"] / 1e6 for r in rs], w, label="uplink")
        ax.bar([i + w / 2 for i in x], [r["bytes_down"] / 1e6 for r in rs], w, label="downlink")
        ax.set_xticks(x)
        ax.set_xlabel("round")
        ax.set_ylabel("MB per round (all clients)")
        ax.legend(fontsize=8)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke only (<= 5 min)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_main.json"))
    ap.add_argument("--experiments", default=None, help="comma-separated (default smoke,default)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args(argv)
    names = (args.experiments.split(",") if args.experiments
             else ["smoke"] if args.quick else ["smoke", "default"])
    out = Path(args.out).resolve()
    runs_root = out.parent / (out.stem + "_runs")
    report = {"machine": {"cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                          "python": platform.python_version(), "platform": platform.platform()},
              "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "experiments": []}
    for name in names:
        print(f"[bench] running {name} ...", flush=True)
        e = run_experiment(name, runs_root / name, args.overrides)
        cfg = load_results(e["results_json"])["config"]
        e["parallel_clients"] = max(1, min(e["clients"], (psutil.cpu_count() or 1)
                                           // int(cfg["federation"]["client_num_cpus"])))
        report["experiments"].append(e)
        print(f"[bench] {name}: {e['wall_s']:.0f} s, peak PSS {e['peak_pss_bytes'] / 2**30:.2f} GiB, "
              f"max aggregation {e['max_aggregate_s'] * 1000:.0f} ms/round", flush=True)
    if len(report["experiments"]) > 1:
        a, b = report["experiments"][0], report["experiments"][-1]
        report["ratios"] = {f"{b['experiment']}/{a['experiment']} wall": b["wall_s"] / a["wall_s"],
                            f"{b['experiment']}/{a['experiment']} peak_pss":
                                b["peak_pss_bytes"] / max(a["peak_pss_bytes"], 1)}
    for e in report["experiments"]:
        total = sum(r["round_s"] for r in e["rounds"])
        e["aggregation_share_of_round_time"] = sum(r["aggregate_s"] for r in e["rounds"]) / total
    atomic_write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(json.dumps({e["experiment"]: {"wall_s": round(e["wall_s"], 1),
                                        "peak_pss_GiB": round(e["peak_pss_bytes"] / 2**30, 2),
                                        "max_aggregate_ms": round(e["max_aggregate_s"] * 1e3, 1)}
                      for e in report["experiments"]}, indent=2))
    print(f"[bench] wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
