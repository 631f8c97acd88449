"""Hydra entry point: run the Flower simulation for one composed config (or a sweep).

Each Hydra job fetches the models its federation names (once, into the cache), then
runs ``flwr run <app> local --stream`` with the job's overrides passed through the
Flower run config, so the ServerApp composes exactly the same config. Values that depend
on this shell's environment (cache folder, data mirror) are pinned as explicit
overrides, because the local SuperLink may be a process started earlier with another
environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from edgefuse.app import checkpoint, phases
from edgefuse.app.device import keys_root
from edgefuse.cli.common import one_line, quote_override
from edgefuse.config import CONF_DIR, ConfigError, hub_for_null_mirror, resolve_paths, validate
from edgefuse.data import HUB, check_data_config, mirror_file
from edgefuse.eval.splits import public_slices
from edgefuse.models import ModelFetchError, ModelSpecError, get_spec, is_fetched
from edgefuse.results import RunRecorder, load_results
from edgefuse.transport.identity import CLOUD, provision

APP_DIR = Path(__file__).resolve().parents[2]  # the Flower app: the folder with pyproject.toml

FLOWER_ENV = {
    # Without this, every run `uv sync`s the app's dependencies (torch included).
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


class RunFailed(RuntimeError):
    """``flwr run`` exited non-zero or the run did not complete."""


def pinned_overrides(cfg: DictConfig, task_overrides: list[str]) -> list[str]:
    """The job's overrides plus the cache and mirror of ``cfg`` (as
    :func:`edgefuse.config.resolve_paths` filled them), always explicit.

    A long-lived local SuperLink composes the config in its own environment, so nothing
    environment-dependent is left for it to fill in (``data.mirror=hub`` = the hub). The
    job's own ``paths.cache_dir`` / ``data.mirror`` overrides give way to their resolved
    values.
    """
    mirror = cfg.data.get("mirror")
    pinned = ("paths.cache_dir", "data.mirror")
    items = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") not in pinned]
    items.append(f"paths.cache_dir={quote_override(str(cfg.paths.cache_dir))}")
    items.append("data.mirror=" + (quote_override(str(mirror)) if mirror else HUB))
    return items


def foreign_superlink() -> str | None:
    """The command line of a running local simulation SuperLink started from another
    Python environment or with another ``PYTHONPATH`` (its runs would use that code), else
    None."""
    import psutil

    mine = Path(sys.executable).parent
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(c.endswith("flower-superlink") for c in cmd[:2]) and "--simulation" in cmd:
            if not any(Path(c).parent == mine for c in cmd[:2]):
                return " ".join(cmd[:2])
            try:
                theirs = p.environ().get("PYTHONPATH", "")
            except (psutil.Error, OSError):
                continue
            if theirs != os.environ.get("PYTHONPATH", ""):
                return f"{' '.join(cmd[:2])} with PYTHONPATH={theirs or '(none)'}"
    return None


def prefetch(cfg: DictConfig) -> None:
    """Fetch every embedded model the federation names, and the cloud's target when the
    cloud phase is on (clients would race otherwise).

    Runs in a child process, so the gigabytes a GGUF conversion touches go back to the
    system before the federation starts.

    Raises:
        ModelSpecError: an unknown model name.
        ModelFetchError: the fetch failed (its message is printed above).
    """
    missing = []
    names = [str(c.model) for c in cfg.federation.clients]
    if cfg.get("cloud") and cfg.cloud.get("enabled"):
        names.append(str(cfg.cloud.model))
    for name in dict.fromkeys(names):
        spec = get_spec(name)
        if spec.embedded and not is_fetched(spec, cfg.paths.cache_dir):
            missing.append(name)
    if not missing:
        return
    cmd = [sys.executable, "-m", "edgefuse.cli", "models", "fetch", *missing,
           "--cache-dir", str(cfg.paths.cache_dir)]
    if subprocess.run(cmd).returncode != 0:
        raise ModelFetchError(f"fetching {', '.join(missing)} failed (see above)")


def run_flower(cfg: DictConfig, overrides: list[str], out: Path) -> dict:
    """Run one simulation through ``flwr run``; return the parsed results.json.

    ``flwr``'s output is streamed through; Ctrl-C stops the run on the SuperLink too
    (``flwr stop``) and marks results.json ``stopped``.

    Raises:
        RunFailed: ``flwr`` is missing, exits non-zero, or results.json says failed.
        KeyboardInterrupt: the user stopped the run.
    """
    flwr = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    if not Path(flwr).exists():
        raise RunFailed("the `flwr` command is not installed: install edgefuse first (see README)")
    out.mkdir(parents=True, exist_ok=True)
    # the operator's step: every device's and the cloud's identity, and the keys they pin
    prints = provision(keys_root(), len(cfg.federation.clients))
    print(f"[edgefuse] identities in {keys_root()} (cloud {prints[CLOUD]})", flush=True)
    run_config = out / "run_config.toml"
    run_config.write_text(
        "experiment = " + _toml_str(str(cfg.experiment.name)) + "\n"
        "overrides = " + _toml_str(shlex.join(overrides)) + "\n"
        "output-dir = " + _toml_str(str(out)) + "\n"
    )
    fed = (f"num-supernodes={len(cfg.federation.clients)} "
           f"client-resources-num-cpus={int(cfg.federation.client_num_cpus)}")
    cmd = [flwr, "run", str(APP_DIR), "local", "--stream",
           "--federation-config", fed, "--run-config", str(run_config)]
    print("[edgefuse] " + shlex.join(cmd), flush=True)
    # flwr starts `flower-superlink` from PATH: make this environment's scripts visible.
    env = {**os.environ, **FLOWER_ENV,
           "PATH": os.pathsep.join([str(Path(flwr).parent), os.environ.get("PATH", "")])}
    run_id = None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            if run_id is None and (m := re.search(r"started run (\d+)", line)):
                run_id = m.group(1)
        proc.wait()
    except KeyboardInterrupt:
        print(f"\n[edgefuse] interrupted: stopping run {run_id} ...", flush=True)
        if run_id:
            subprocess.run([flwr, "stop", run_id, "local"], env=env, capture_output=True)
        proc.terminate()
        _mark_stopped(out / "results.json")
        raise
    results_path = out / "results.json"
    if not results_path.exists():
        raise RunFailed(f"`flwr run` exited with {proc.returncode} and wrote no {results_path}")
    results = load_results(results_path)
    if results.get("status") != "completed":
        raise RunFailed(f"the run {results.get('status')}: {results.get('error')} (see {out})")
    if proc.returncode != 0:
        raise RunFailed(f"`flwr run` exited with {proc.returncode} (see {out})")
    return results


def _wait_for_serverapp_exit(timeout_s: float = 60.0) -> None:
    """After ``flwr stop``, the simulation process finishes the step it is in before it
    exits; wait for that (a zombie counts as gone) so it cannot write after us."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for p in psutil.process_iter(["cmdline", "status"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "flwr-simulation" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
        if not alive:
            return
        time.sleep(0.5)


def _mark_stopped(path: Path) -> None:
    """Record a user stop in results.json (the stopped ServerApp could not)."""
    _wait_for_serverapp_exit()
    if path.exists():
        rec = RunRecorder(path.parent, {})
        rec.results = load_results(path)
        if rec.results.get("status") == "running":
            rec.finish("stopped", error="stopped by the user (Ctrl-C)")


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def discard_unused_run_dir(out: Path) -> bool:
    """Remove the run folder ``out`` if it holds nothing but Hydra's ``.hydra`` record: a
    launch that stopped before running leaves no empty folder behind. A folder with anything
    else in it (a user's files, a checkpoint a restart resumes from, partial results) is
    kept whole. Returns whether it was removed."""
    try:
        entries = list(out.iterdir())
    except OSError:
        return False
    if any(e.name != ".hydra" for e in entries):
        return False
    shutil.rmtree(out / ".hydra", ignore_errors=True)
    try:
        out.rmdir()
    except OSError:
        return False
    return True


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    """One Hydra job = one federated run, in the job's own output folder."""
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir).resolve()
    t0 = time.monotonic()
    try:
        task = list(hc.overrides.task)
        if any(hub_for_null_mirror(o) != o for o in task):  # data.mirror=null on purpose: the hub
            cfg.data.mirror = HUB
        resolve_paths(cfg)
        validate(cfg)
        phases.check(cfg)
        check_data_config(cfg.data)
        mirror_file(cfg.data)  # fail here, not in every client
        public_slices(cfg.data, int(cfg.seed))  # and a public split too small for its slices
        prefetch(cfg)
        if other := foreign_superlink():
            print(f"[edgefuse] warning: the running local SuperLink ({other}) belongs to another "
                  "Python environment and runs that environment's edgefuse code; stop it "
                  "(`pkill -f flower-superlink`) to use this one.", file=sys.stderr, flush=True)
        overrides = pinned_overrides(cfg, task)
        if checkpoint.files(out):  # a folder of another config is refused here, in one line
            checkpoint.latest(out, phases.compose(str(cfg.experiment.name), shlex.join(overrides)))
        run_flower(cfg, overrides, out)
    except KeyboardInterrupt:
        print(f"[edgefuse] stopped; partial results in {out}", file=sys.stderr, flush=True)
        sys.exit(130)
    except (ConfigError, ModelSpecError, ModelFetchError, FileNotFoundError, ValueError, RuntimeError) as e:
        discard_unused_run_dir(out)  # nothing ran: leave no empty folder behind
        print(f"edgefuse: error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"[edgefuse] done in {(time.monotonic() - t0) / 60:.1f} min: {out}", flush=True)
