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
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from edgefuse.config import CONF_DIR, ConfigError, validate
from edgefuse.models import ModelFetchError, ModelSpecError, cache_dir, get_spec, is_fetched
from edgefuse.results import load_results

APP_DIR = CONF_DIR.parent

FLOWER_ENV = {
    # Without this, every run `uv sync`s the app's dependencies (torch included).
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


class RunFailed(RuntimeError):
    """``flwr run`` exited non-zero or the run did not complete."""


def _quote(value: str) -> str:
    """Quote a value for the Hydra override grammar."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def pinned_overrides(cfg: DictConfig, task_overrides: list[str]) -> list[str]:
    """The job's overrides plus this environment's cache and mirror as absolute paths."""
    items = list(task_overrides)
    items.append(f"paths.cache_dir={_quote(str(cache_dir(cfg.paths.cache_dir)))}")
    if cfg.data.get("mirror"):
        items.append(f"data.mirror={_quote(str(Path(cfg.data.mirror).expanduser().resolve()))}")
    return items


def prefetch(cfg: DictConfig) -> None:
    """Fetch every embedded model the federation names (clients would race otherwise).

    Runs in a child process, so the gigabytes a GGUF conversion touches go back to the
    system before the federation starts.

    Raises:
        ModelSpecError: an unknown model name.
        ModelFetchError: the fetch failed (its message is printed above).
    """
    missing = []
    for name in dict.fromkeys(str(c.model) for c in cfg.federation.clients):
        spec = get_spec(name)
        if spec.embedded and not is_fetched(spec, cfg.paths.cache_dir):
            missing.append(name)
    if not missing:
        return
    cmd = [sys.executable, "-m", "edgefuse.cli", "models", "fetch", *missing,
           "--cache-dir", str(cache_dir(cfg.paths.cache_dir))]
    if subprocess.run(cmd).returncode != 0:
        raise ModelFetchError(f"fetching {', '.join(missing)} failed (see above)")


def run_flower(cfg: DictConfig, overrides: list[str], out: Path) -> dict:
    """Run one simulation through ``flwr run``; return the parsed results.json.

    Raises:
        RunFailed: ``flwr`` is missing, exits non-zero, or results.json says failed.
    """
    flwr = shutil.which("flwr") or str(Path(sys.executable).parent / "flwr")
    if not Path(flwr).exists():
        raise RunFailed("the `flwr` command is not installed: install edgefuse first (see README)")
    out.mkdir(parents=True, exist_ok=True)
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
    path = os.pathsep.join([str(Path(flwr).parent), os.environ.get("PATH", "")])
    proc = subprocess.run(cmd, env={**os.environ, **FLOWER_ENV, "PATH": path})
    results_path = out / "results.json"
    if not results_path.exists():
        raise RunFailed(f"`flwr run` exited with {proc.returncode} and wrote no {results_path}")
    results = load_results(results_path)
    if proc.returncode != 0 or results.get("status") != "completed":
        raise RunFailed(f"run failed (flwr exit {proc.returncode}): {results.get('error')}; "
                        f"see {out}")
    return results


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    """One Hydra job = one federated run, in the job's own output folder."""
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir).resolve()
    try:
        validate(cfg)
        prefetch(cfg)
        run_flower(cfg, pinned_overrides(cfg, list(hc.overrides.task)), out)
    except (ConfigError, ModelSpecError, ModelFetchError, RunFailed) as e:
        print(f"edgefuse: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"[edgefuse] done: {out}", flush=True)
