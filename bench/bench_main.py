"""Benchmark the main job per phase: wall time, CPU time and peak memory (PSS) of every phase.

Runs ``edgefuse run experiment=<name>`` for each experiment (default: ``default``) one after
the other, in this checkout (or the one ``--repo`` names, with its own Python), and samples
every 0.5 s, over all processes of the federation (launcher, SuperLink, simulation, Ray
workers, the cloud service): their summed PSS, their summed CPU time and the machine's
1-minute load average. The run's results.json is polled too: each phase saves it when it
ends, which places the phase on the sample timeline (its start is its end minus the
seconds it reports), so every phase gets its own peak PSS, CPU seconds and load.

    python bench/bench_main.py                          # the main job (~12 min here, models cached)
    python bench/bench_main.py --experiments default,full   # + today's budgets (~100 min)
    python bench/bench_main.py --quick                  # smoke only (< 5 min)
    python bench/bench_main.py --label before --repo /tmp/wt-before   # another checkout's code

Throughput figures per experiment (``rates``): fuser training examples/s (steps × batch
over the fusers' own training seconds), C2C evaluation queries/s (query × mode answers over
the evaluation's wall time), cloud service start seconds and decoding tokens/s (all modes'
tokens over their wall time), privacy probe seconds. ``--label`` tags the runs (e.g.
``before``/``after`` a speed fix); with ``--append`` the runs are added to an existing JSON
(a run of the same label and experiment replaced), so the PNG sets labels side by side.

By default each run goes to a SuperLink of its own (``FLWR_HOME`` under the runs folder,
free local ports), started by ``flwr`` on first use and stopped at the end, so a SuperLink
someone else started (with their checkout's code) neither serves nor stops these runs;
``--shared-superlink`` uses the machine's default local SuperLink instead.

The JSON is rewritten atomically after every phase of every run (a stopped bench keeps
what it measured) and a PNG is written beside it (same stem). Machines here are shared
and noisy: the load average is recorded next to every figure.
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

from edgefuse.io import atomic_write_json  # noqa: E402

# Processes that belong to a federated run (matched against the command line), for a run on
# the machine's shared SuperLink, where runs cannot be told apart.
FEDERATION_MARKERS = ("flower-superlink", "flower-superexec", "flwr-simulation", "flwr",
                      "ray::", "raylet", "gcs_server", "edgefuse", "default_worker.py")
# Phases in the order the ServerApp runs them, as keys of a round's ``seconds``.
ROUND_KEYS = ("train", "aggregate", "evaluate", "fusers")
RUN_KEYS = ("c2c_eval", "decoding", "privacy")


def run_processes(root_pid: int | None, home: Path | None) -> list[psutil.Process]:
    """The processes of one run: the launcher ``root_pid`` and, with a SuperLink of the
    bench's own (``FLWR_HOME`` = ``home``), that SuperLink, with all their descendants (the
    simulation, Ray's processes and workers, the cloud service). With ``home=None`` (the
    machine's shared SuperLink) every process matching :data:`FEDERATION_MARKERS` counts."""
    roots = []
    if root_pid is not None:
        try:
            roots.append(psutil.Process(root_pid))
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            line = " ".join(cmd)
            if home is not None:
                if any(c.endswith("flower-superlink") for c in cmd[:2]) and str(home) in line:
                    roots.append(p)
            elif p.pid != os.getpid() and any(m in line for m in FEDERATION_MARKERS):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found: dict[int, psutil.Process] = {}
    for r in roots:
        found[r.pid] = r
        try:
            for c in r.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def federation_memory(root_pid: int | None = None, home: Path | None = None) -> int:
    """Summed PSS (bytes) of the processes of a run (:func:`run_processes`).

    PSS (proportional set size) splits shared pages (torch's libraries, Ray's object store)
    between the processes that map them, so the sum is not inflated the way an RSS sum is.
    """
    total = 0
    for p in run_processes(root_pid, home):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class Sampler(threading.Thread):
    """Every ``interval`` s: the run's CPU seconds and the load average, and the phase keys
    results.json holds so far (polled under ``run_root``); every ``pss_every`` samples its
    PSS too (reading PSS walks each process's page tables: ~0.6 s of CPU for a run's dozen
    processes here, so it is sampled less often than the cheap counters).

    ``samples``: ``[(t, pss_bytes or None, cpu_s, load1)]`` with ``t`` seconds since start;
    ``cpu_s`` counts each process's user+system time once, kept after it exits.
    ``marks``: ``{phase key: t first seen in results.json}`` (``"<r>:<key>"`` for round keys,
    ``"results"`` when results.json first appeared, ``"done"`` at a final status).
    """

    def __init__(self, run_root: Path, interval: float = 1.0, pss_every: int = 5, on_mark=None,
                 ignore=(), home: Path | None = None):
        super().__init__(daemon=True)
        self.run_root, self.interval, self.on_mark = run_root, interval, on_mark
        self.pss_every, self._n = max(1, int(pss_every)), 0
        self.home, self.root_pid = home, None  # root_pid: the launcher, once started
        self.ignore = set(ignore)  # results.json files of earlier runs
        self.samples: list[tuple[float, int, float, float]] = []
        self.marks: dict[str, float] = {}
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create_time) -> cpu seconds
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    @property
    def peak(self) -> int:
        return max((s[1] for s in self.samples if s[1] is not None), default=0)

    def _sample(self, with_pss: bool | None = None) -> None:
        with_pss = self._n % self.pss_every == 0 if with_pss is None else with_pss
        self._n += 1
        pss = 0 if with_pss else None
        for p in run_processes(self.root_pid, self.home):
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    ct = p.cpu_times()
                    self._cpu[key] = ct.user + ct.system
                    if with_pss:
                        pss += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        t = time.perf_counter() - self.t0
        self.samples.append((t, pss, sum(self._cpu.values()), os.getloadavg()[0]))

    def _poll_results(self) -> None:
        found = sorted(set(self.run_root.glob("*/results.json")) - self.ignore)
        if not found:
            return
        t = time.perf_counter() - self.t0
        new = []
        self.marks.setdefault("results", t)
        try:
            res = json.loads(found[-1].read_text())
        except (OSError, ValueError):
            return  # written atomically, so only a vanished file; next poll
        for rd in res.get("rounds", []):
            for k in rd.get("seconds", {}):
                name = k if k in RUN_KEYS else f"{rd['round']}:{k}"
                if name not in self.marks:
                    self.marks[name] = t
                    new.append(name)
        if res.get("status") in ("completed", "failed", "stopped") and "done" not in self.marks:
            self.marks["done"] = t
            new.append("done")
        if new and self.on_mark:
            self.on_mark()

    def run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            self._poll_results()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self._sample(with_pss=False)
        self._poll_results()


def phase_intervals(res: dict, marks: dict[str, float]) -> list[dict]:
    """``[{"phase", "round", "start", "end", "seconds"}]`` on the sampler's clock.

    A phase ends when results.json first shows its key; it started ``seconds`` before
    (the ServerApp's own timing). Round phases that share one save (train, aggregate,
    evaluate and, after the last round, fusers) are laid back to back before that save."""
    out = []
    for rd in res.get("rounds", []):
        secs = rd.get("seconds", {})
        keys = [k for k in ROUND_KEYS if k in secs]
        ends = [marks.get(f"{rd['round']}:{k}") for k in keys]
        if not keys or ends[-1] is None:
            continue
        end = ends[-1]
        for k in reversed(keys):  # back to back before the save that showed them
            out.append({"phase": k, "round": rd["round"], "start": end - secs[k], "end": end,
                        "seconds": secs[k]})
            end -= secs[k]
    last = res["rounds"][-1]["seconds"] if res.get("rounds") else {}
    for k in RUN_KEYS:
        if k in last and k in marks:
            out.append({"phase": k, "round": None, "start": marks[k] - last[k], "end": marks[k],
                        "seconds": last[k]})
    return sorted(out, key=lambda p: p["start"])


def window(samples, start: float, end: float) -> dict:
    """Peak PSS, CPU seconds used and mean load average of the samples in ``[start, end]``."""
    inside = [s for s in samples if start <= s[0] <= end]
    before = [s for s in samples if s[0] <= start]
    after = [s for s in samples if s[0] >= end]
    cpu0 = before[-1][2] if before else (inside[0][2] if inside else 0.0)
    cpu1 = after[0][2] if after else (inside[-1][2] if inside else cpu0)
    return {"peak_pss_bytes": max((s[1] for s in inside if s[1] is not None), default=None),
            "cpu_seconds": cpu1 - cpu0,
            "load1_mean": (sum(s[3] for s in inside) / len(inside)) if inside else None}


def rates(res: dict) -> dict:
    """Throughput of the phases from a results.json (see the module docstring)."""
    cfg = res.get("config", {})
    out: dict = {}
    last = res["rounds"][-1]["seconds"] if res.get("rounds") else {}
    trained = [f for f in res.get("fusers") or [] if f.get("action") == "trained"]
    if trained:
        bs = int(cfg.get("c2c", {}).get("train", {}).get("batch_size", 1))
        ex = sum(int(f["train_steps"]) * bs for f in trained)
        secs = sum(float(f["train_seconds"]) for f in trained)
        out["fuser_pairs_trained"] = len(trained)
        out["fuser_train_examples"] = ex
        out["fuser_train_examples_per_s"] = ex / secs if secs else None
        out["fuser_seconds_per_pair"] = secs / len(trained)
    rows = [r for r in res.get("c2c") or [] if r.get("n")]
    if rows and last.get("c2c_eval"):
        answers = sum(int(r["n"]) for r in rows)
        out["c2c_rows"] = len(rows)
        out["c2c_queries_per_row"] = max(int(r["n"]) for r in rows)
        out["c2c_answers"] = answers
        out["c2c_answers_per_s"] = answers / last["c2c_eval"]
        by_mode: dict[str, list[float]] = {}
        for r in rows:
            if r.get("wall_seconds"):
                by_mode.setdefault(r["mode"], []).append(int(r["n"]) / r["wall_seconds"])
        out["c2c_answers_per_s_by_mode"] = {m: sum(v) / len(v) for m, v in by_mode.items()}
    dec = res.get("decoding")
    if isinstance(dec, list) and dec:
        recs = res.get("decoding_records") or []
        toks = sum(int(r.get("new_tokens") or 0) for r in dec)
        svc = (res.get("summary") or {}).get("cloud_service") or {}
        out["decoding_new_tokens"] = toks
        out["decoding_generations"] = len(recs) or sum(int(r.get("prompts") or 0) for r in dec)
        if last.get("decoding"):
            out["decoding_tokens_per_s_phase"] = toks / last["decoding"]
        if svc.get("start_seconds") is not None:
            out["cloud_service_start_s"] = svc["start_seconds"]
    priv = (res.get("summary") or {}).get("privacy") or {}
    if priv.get("probe_seconds") is not None:
        out["privacy_probe_s"] = priv["probe_seconds"]
    if priv.get("stage_seconds"):
        out["privacy_stage_seconds"] = priv["stage_seconds"]
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def own_superlink_env(home: Path) -> dict[str, str]:
    """Environment for ``flwr`` to start (and reuse) a local SuperLink of its own:
    ``FLWR_HOME`` at ``home`` and free ports for its HTTP and Control APIs."""
    home.mkdir(parents=True, exist_ok=True)
    return {"FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}


def stop_own_superlink(home: Path) -> int:
    """Terminate the SuperLink ``flwr`` started under ``home`` (its log file lies there);
    returns how many processes were asked to stop."""
    mine = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(c.endswith("flower-superlink") for c in cmd[:2]) and any(str(home) in c for c in cmd):
            mine.append(p)
    for p in mine:
        p.terminate()
    psutil.wait_procs(mine, timeout=30)
    return len(mine)


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq; guest time is inside user, steal is the hypervisor's)."""
    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq"))


def run_experiment(name: str, out_root: Path, extra: list[str], repo: Path, python: str,
                   label: str, on_progress=None, env: dict | None = None) -> dict:
    """One main-job run; returns its measured figures (``on_progress(partial)`` after
    every phase).

    Raises:
        RuntimeError: the run failed (the tail of its log is included).
    """
    from edgefuse.results import load_results

    out_root.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "edgefuse.cli", "run", f"experiment={name}", f"outputs.root={out_root}",
           *extra]
    log_path = out_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}.log"
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    entry = {"experiment": name, "label": label, "overrides": list(extra),
             "command": " ".join(cmd), "repo": str(repo),
             "commit": _git(repo, "rev-parse", "HEAD"),
             "modified_files": len(dirty.splitlines()),
             "log": str(log_path), "load_before": list(os.getloadavg())}
    known = set(out_root.glob("*/results.json"))

    def progress() -> None:
        if on_progress:
            on_progress({**entry, "partial": True, "marks": dict(sampler.marks)})

    home = Path(env["FLWR_HOME"]) if env and "FLWR_HOME" in env else None
    sampler = Sampler(out_root, on_mark=progress, ignore=known, home=home)
    busy0, own0 = machine_busy_seconds(), time.process_time()
    t0 = sampler.t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=repo, stdout=logf, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        sampler.root_pid = proc.pid
        sampler.start()
        proc.wait()
    wall = time.perf_counter() - t0
    sampler.stop()
    busy, own = machine_busy_seconds() - busy0, time.process_time() - own0
    runs = sorted(set(out_root.glob("*/results.json")) - known)
    if proc.returncode != 0 or not runs:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}, log {log_path}):\n{tail}")
    res = load_results(runs[-1])
    phases = phase_intervals(res, sampler.marks)
    for p in phases:
        p.update(window(sampler.samples, p["start"], p["end"]))
    started = sampler.marks.get("results", 0.0)
    done = sampler.marks.get("done", wall)
    rounds = []
    for rd in res["rounds"]:
        ok = [c for c in rd["clients"] if c["status"] == "ok"]
        rounds.append({
            "round": rd["round"], **{f"{k}_s": v for k, v in rd["seconds"].items()},
            "client_train_s_sum": sum(c.get("train_seconds", 0.0) for c in ok),
            "client_train_s_max": max((c.get("train_seconds", 0.0) for c in ok), default=0.0),
            "client_model_load_s_sum": sum(c.get("load_seconds", 0.0) for c in ok),
            "bytes_up": sum(c["bytes_up"] for c in rd["clients"]),
            "bytes_down": sum(c["bytes_down"] for c in rd["clients"]),
        })
    last = res["rounds"][-1]["clients"]
    entry.update({
        "partial": False,
        "results_json": str(runs[-1]),
        "clients": len(last),
        "models": sorted({c["model"] for c in last}),
        "wall_s": wall,
        "startup_s": started,  # launcher, SuperLink, simulation start until results.json
        "server_s": done - started,
        "teardown_s": wall - done,
        "peak_pss_bytes": sampler.peak,
        "cpu_seconds": sampler.samples[-1][2] if sampler.samples else None,
        # all CPUs' busy seconds during the run, and the share the run's processes did not use
        # (other users of the machine; this bench's own sampling is bench_cpu_seconds)
        "machine_busy_cpu_seconds": busy,
        "bench_cpu_seconds": own,
        "others_cpu_share": (max(busy - (sampler.samples[-1][2] if sampler.samples else 0) - own, 0.0)
                             / busy) if busy else None,
        "load_after": list(os.getloadavg()),
        "load1_mean": (sum(s[3] for s in sampler.samples) / len(sampler.samples)) if sampler.samples else None,
        "phases": phases,
        "phase_seconds": _phase_totals(phases),
        "rounds": rounds,
        "rates": rates(res),
        "memory_trace": [(round(t, 1), pss) for t, pss, _, _ in sampler.samples if pss is not None],
        "final_minus_base_loss": {f"p{c['partition_id']} {c['model']} r{c['lora_rank']}":
                                  (c["eval_loss"] - c["base_eval_loss"])
                                  if c["eval_loss"] is not None and c["base_eval_loss"] is not None
                                  else None for c in last},
    })
    return entry


def _phase_totals(phases: list[dict]) -> dict[str, float]:
    """Seconds per phase name summed over rounds (``train`` = all rounds' training)."""
    tot: dict[str, float] = {}
    for p in phases:
        tot[p["phase"]] = tot.get(p["phase"], 0.0) + p["seconds"]
    return tot


def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def recorded_jobs(report: dict) -> set[tuple[str, str, tuple[str, ...]]]:
    """``{(label, experiment, overrides)}`` of the runs a bench JSON holds (older files
    without ``overrides``: the words of ``command`` after ``outputs.root=...``)."""
    jobs = set()
    for e in report.get("experiments", []):
        extra = e.get("overrides")
        if extra is None:
            words = e.get("command", "").split()
            at = next((i for i, w in enumerate(words) if w.startswith("outputs.root=")), len(words))
            extra = words[at + 1:]
        jobs.add((e.get("label", ""), e["experiment"], tuple(extra)))
    return jobs


def check_overwrite(out: Path, jobs: set, force: bool, append: bool) -> str | None:
    """Why writing ``jobs`` to ``out`` must not go ahead (one line), or None: ``out`` is new,
    unreadable as a report, holds the same jobs, or ``--force`` / ``--append`` was given."""
    if force or append or not out.exists():
        return None
    try:
        held = recorded_jobs(json.loads(out.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if held == jobs:
        return None

    def show(js):
        return "; ".join(f"{exp}{f' [{lab}]' if lab else ''} {' '.join(ov) or '(no overrides)'}"
                         for lab, exp, ov in sorted(js)) or "nothing"

    return (f"{out} holds another job ({show(held)}), this one is {show(jobs)}: pass --force to "
            "overwrite it, --append to add to it, or --out for a new file")


PHASE_ORDER = ("startup", "train", "aggregate", "evaluate", "fusers", "c2c_eval", "decoding",
               "privacy", "teardown")


def plot(report: dict, path: Path) -> None:
    """Left: wall seconds per phase, stacked, one bar per (label, experiment), with each
    bar's peak PSS. Right: the throughput figures side by side per label."""
    from matplotlib.figure import Figure

    exps = [e for e in report["experiments"] if not e.get("partial")]
    if not exps:
        return
    fig = Figure(figsize=(13, 5.5), constrained_layout=True)
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = [f"{e['label']}\n{e['experiment']}" if e.get("label") else e["experiment"] for e in exps]
    x = range(len(exps))
    bottom = [0.0] * len(exps)
    for ph in PHASE_ORDER:
        vals = [e["startup_s"] if ph == "startup" else e["teardown_s"] if ph == "teardown"
                else e["phase_seconds"].get(ph, 0.0) for e in exps]
        if not any(vals):
            continue
        ax.bar(x, [v / 60 for v in vals], bottom=[b / 60 for b in bottom], label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, e in enumerate(exps):
        ax.text(i, e["wall_s"] / 60, f"{e['wall_s'] / 60:.1f} min\n{e['peak_pss_bytes'] / 2**30:.1f} GiB PSS\n"
                f"load {e['load1_mean']:.1f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(15, color="k", ls="--", lw=0.8)
    ax.text(len(exps) - 0.5, 15, " 15 min", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("wall minutes (2 CPU cores)")
    ax.set_title("main job per phase")
    ax.legend(fontsize=8, ncol=2)
    metrics = (("fuser_train_examples_per_s", "fuser train ex/s"),
               ("c2c_answers_per_s", "C2C eval answers/s"),
               ("decoding_tokens_per_s_phase", "decoding tok/s (phase)"))
    w = 0.8 / len(exps)
    for i, e in enumerate(exps):
        vals = [e["rates"].get(k) or 0.0 for k, _ in metrics]
        ax2.bar([j + i * w for j in range(len(metrics))], vals, w, label=names[i].replace("\n", " "))
    ax2.set_xticks([j + w * (len(exps) - 1) / 2 for j in range(len(metrics))], [m for _, m in metrics],
                   fontsize=8)
    ax2.set_title("throughput (higher is better)")
    ax2.legend(fontsize=8)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke only (<= 5 min)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_main.json"))
    ap.add_argument("--experiments", default=None,
                    help="comma-separated experiment names (default: default; e.g. default,full)")
    ap.add_argument("--label", default="", help="tag for these runs, e.g. before / after")
    ap.add_argument("--append", action="store_true",
                    help="add to the runs already in --out (same label + experiment replaced)")
    ap.add_argument("--force", action="store_true",
                    help="overwrite --out even when it records other experiments or overrides")
    ap.add_argument("--repo", default=str(ROOT), help="checkout to run (default: this one)")
    ap.add_argument("--python", default=None,
                    help="its Python (default: <repo>/.venv/bin/python, else this one)")
    ap.add_argument("--shared-superlink", action="store_true",
                    help="use the machine's default local SuperLink, not one of the bench's own")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args(argv)
    names = (args.experiments.split(",") if args.experiments
             else ["smoke"] if args.quick else ["default"])
    repo = Path(args.repo).resolve()
    python = args.python or (str(repo / ".venv" / "bin" / "python")
                             if (repo / ".venv" / "bin" / "python").exists() else sys.executable)
    out = Path(args.out).resolve()
    runs_root = out.parent / (out.stem + "_runs")
    if why := check_overwrite(out, {(args.label, n, tuple(args.overrides)) for n in names},
                              args.force, args.append):
        print(f"bench_main: error: {why}", file=sys.stderr)
        return 2
    report = {"experiments": []}
    if args.append and out.exists():
        report = json.loads(out.read_text())
    report.update({"machine": {"cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                               "python": platform.python_version(), "platform": platform.platform()},
                   "command": " ".join(["bench/bench_main.py", *(argv if argv is not None else sys.argv[1:])])})

    def put(entry: dict) -> None:
        report["experiments"] = [e for e in report["experiments"]
                                 if (e.get("label", ""), e["experiment"]) != (entry["label"], entry["experiment"])]
        report["experiments"].append(entry)
        atomic_write_json(out, report)

    home = runs_root / "flwr-home"
    env = None if args.shared_superlink else own_superlink_env(home)
    try:
        for name in names:
            print(f"[bench] running {name} ({args.label or 'unlabelled'}, {repo}) ...", flush=True)
            sub = runs_root / (f"{args.label}-{name}" if args.label else name)
            try:
                e = run_experiment(name, sub, args.overrides, repo, python, args.label,
                                   on_progress=put, env=env)
            except RuntimeError as err:
                print(f"bench_main: error: {str(err).splitlines()[0]}", file=sys.stderr)
                return 1
            put(e)
            print(f"[bench] {name}: {e['wall_s']:.0f} s wall ({e['startup_s']:.0f} s start-up), "
                  f"peak PSS {e['peak_pss_bytes'] / 2**30:.2f} GiB, load {e['load1_mean']:.1f}; "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in e["phase_seconds"].items()), flush=True)
            plot(report, out.with_suffix(".png"))
    finally:
        if env is not None:
            stop_own_superlink(home)
    print(json.dumps({f"{e.get('label', '')}/{e['experiment']}": {
        "wall_s": round(e["wall_s"], 1), "peak_pss_GiB": round(e["peak_pss_bytes"] / 2**30, 2),
        **{k: round(v, 1) for k, v in e["phase_seconds"].items()},
        **{k: round(v, 3) for k, v in e["rates"].items() if isinstance(v, float)}}
        for e in report["experiments"] if not e.get("partial")}, indent=2))
    print(f"[bench] wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
