"""edgefuse ServerApp: R rounds of per-model federated LoRA, evaluation and outputs.

The route from ``flwr run .`` to a result row: :func:`main` composes the config,
:class:`~edgefuse.app.strategy.GroupedLoRA` builds the messages and aggregates the
replies (math in :mod:`edgefuse.aggregation`), and :mod:`edgefuse.results` writes the
output folder after every round.
"""

from __future__ import annotations

import time
from datetime import datetime
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from omegaconf import OmegaConf

from edgefuse.app.phases import compose
from edgefuse.config import lora_targets
from edgefuse.lora import save_peft_adapter
from edgefuse.models import get_spec
from edgefuse.results import RunRecorder, print_summary
from edgefuse.app.phases import decoding, privacy
from edgefuse.app.strategy import GroupedLoRA

app = ServerApp()


def output_dir(run_config: dict, cfg) -> Path:
    """The run's output folder: ``output-dir`` if given, else a timestamped one."""
    given = str(run_config.get("output-dir", "") or "")
    if given:
        return Path(given).expanduser().resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (Path(cfg.outputs.root).expanduser() / f"{stamp}-{cfg.experiment.name}").resolve()


def wait_for_nodes(grid: Grid, expected: int, timeout_s: float) -> list[int]:
    """Block until ``expected`` SuperNodes are connected.

    Raises:
        TimeoutError: fewer connected after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while len(nodes := list(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(nodes)} of {expected} SuperNodes connected after {timeout_s:.0f} s: "
                "start one SuperNode per entry of federation.clients")
        time.sleep(1)
    return nodes


def save_adapters(cfg, strategy: GroupedLoRA, group_rows: list[dict], out: Path, round_idx: int) -> None:
    """Save each group's global adapter of this round as a PEFT folder."""
    for g in group_rows:
        res = strategy.groups[g["model"]]
        spec = get_spec(g["model"])
        folder = out / "adapters" / f"round_{round_idx:03d}" / g["model"]
        save_peft_adapter(res.global_state, folder, spec.hub_id or spec.name,
                          res.global_rank, res.global_alpha, lora_targets(cfg, g["model"]))
        g["adapter_dir"] = str(folder)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Compose the config, run the rounds, write the outputs."""
    rc = context.run_config
    cfg = compose(str(rc.get("experiment", "default")), str(rc.get("overrides", "")))
    out = output_dir(rc, cfg)
    out.mkdir(parents=True, exist_ok=True)
    log(INFO, "edgefuse: experiment %s, outputs in %s", cfg.experiment.name, out)
    recorder = RunRecorder(out, OmegaConf.to_container(cfg, resolve=True))
    recorder.save()
    grid = privacy.AuditTally(grid)  # sums every reply's outbound-payload audit
    strategy = GroupedLoRA(cfg)
    fed = cfg.federation
    timeout = float(fed.round_timeout_s)
    t_run = time.perf_counter()
    try:
        phase = _c2c_phase(cfg, grid, strategy, out, timeout)
        cloud_on = bool(cfg.get("cloud") and cfg.cloud.enabled)
        privacy_on = bool(cfg.get("privacy") and cfg.privacy.enabled)
        if cloud_on:
            decoding.check_pair(cfg)  # refuse a pair without a shared tokenizer before any round
        node_ids = wait_for_nodes(grid, len(fed.clients), timeout)
        for r in range(1, int(fed.num_rounds) + 1):
            t0 = time.perf_counter()
            errors = strategy.add_info(grid.send_and_receive(strategy.info_messages(node_ids), timeout=timeout))
            for e in errors:
                log(WARNING, "round %d: node info failed: %s", r, e)
            msgs, sent = strategy.configure(r, "train")
            log(INFO, "round %d/%d: training %d clients (%d steps each)", r, fed.num_rounds,
                len(msgs), cfg.training.steps_per_round)
            replies = list(grid.send_and_receive(msgs, timeout=timeout))
            t_train = time.perf_counter() - t0
            t1 = time.perf_counter()
            rows, group_rows = strategy.aggregate_train(r, replies, sent)
            t_agg = time.perf_counter() - t1
            if cfg.outputs.save_adapters:
                save_adapters(cfg, strategy, group_rows, out, r)
            t2 = time.perf_counter()
            msgs, sent = strategy.configure(r, "evaluate")
            log(INFO, "round %d/%d: aggregated %s in %.2f s; evaluating", r, fed.num_rounds,
                ", ".join(f"{g['model']} ({g['method']})" for g in group_rows), t_agg)
            strategy.aggregate_evaluate(rows, grid.send_and_receive(msgs, timeout=timeout), sent)
            t_eval = time.perf_counter() - t2
            seconds = {"train": t_train, "aggregate": t_agg, "evaluate": t_eval}
            record = {"round": r, "clients": rows, "groups": group_rows, "seconds": seconds}
            recorder.add_round(record)
            recorder.save()
            if phase is not None and (r == int(fed.num_rounds) or str(cfg.c2c.train.at) == "every_round"):
                t3 = time.perf_counter()
                recorder.set_fusers(phase.update_fusers(r))
                seconds["fusers"] = time.perf_counter() - t3
                recorder.add_round(record)
                recorder.save()
            if phase is not None and r == int(fed.num_rounds):
                t4 = time.perf_counter()
                recorder.set_c2c(phase.evaluate(r))
                seconds["c2c_eval"] = time.perf_counter() - t4
            if cloud_on and r == int(fed.num_rounds):
                recorder.add_round(record)
                recorder.save()
                t5 = time.perf_counter()
                recorder.set_decoding(decoding.run(cfg, grid, strategy, out, timeout, r))
                seconds["decoding"] = time.perf_counter() - t5
            if privacy_on and r == int(fed.num_rounds):
                recorder.add_round(record)
                recorder.save()
                t6 = time.perf_counter()
                recorder.set_privacy(privacy.run(cfg, grid, strategy, timeout, r, grid.totals))
                seconds["privacy"] = time.perf_counter() - t6
            seconds["total"] = time.perf_counter() - t0
            recorder.add_round(record)
            recorder.save()
            _log_round(r, rows)
        recorder.set_summary({"wall_seconds": time.perf_counter() - t_run,
                              "server_peak_rss_bytes": _peak_rss()})
        recorder.finish("completed")
    except BaseException as e:
        recorder.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        print_summary(recorder.results, out_dir=out)


def _c2c_phase(cfg, grid: Grid, strategy: GroupedLoRA, out: Path, timeout: float):
    """The Cache-to-Cache phase of this run, or ``None`` when ``c2c.enabled`` is false."""
    if not cfg.get("c2c") or not cfg.c2c.enabled:
        return None
    from edgefuse.c2c.registry import FuserRegistry
    from edgefuse.c2c.hub import FuserService
    from edgefuse.app.phases.c2c import C2CPhase

    root = Path(cfg.c2c.registry_dir).expanduser() if cfg.c2c.registry_dir else out / "fusers"
    return C2CPhase(cfg, grid, strategy, FuserService(cfg, FuserRegistry(root)), timeout)


def _log_round(r: int, rows: list[dict]) -> None:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    for row in rows:
        log(INFO, "round %d  p%d %-20s r%-3d %-8s train %s  eval %s  (base %s)", r,
            row["partition_id"], row["model"], row["lora_rank"], row["status"],
            f(row["train_loss"]), f(row["eval_loss"]), f(row["base_eval_loss"]))


def _peak_rss() -> int:
    """Peak RSS of this process in bytes (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
