"""edgefuse ServerApp: R rounds of per-model federated LoRA, then the phases; the outputs.

The route from ``flwr run .`` to a result row: :func:`main` composes the config, runs each
round with :func:`run_round` (:class:`~edgefuse.app.strategy.GroupedLoRA` builds the
messages and aggregates the replies, the math in :mod:`edgefuse.aggregation`), then runs
each enabled phase of :data:`edgefuse.app.phases.PHASES` in order; :mod:`edgefuse.results`
writes the output folder after every round and every phase, and :mod:`edgefuse.app.checkpoint`
saves the state a restarted run continues from.
"""

from __future__ import annotations

import copy
import time
from datetime import datetime
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from omegaconf import OmegaConf

from edgefuse.app import checkpoint, phases
from edgefuse.app.phases import PhaseContext
from edgefuse.app.phases.privacy import AuditTally
from edgefuse.app.strategy import GroupedLoRA
from edgefuse.config import lora_targets
from edgefuse.lora import save_peft_adapter
from edgefuse.models import get_spec
from edgefuse.results import RunRecorder, print_summary

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
    """Compose the config, run the rounds, then each enabled phase; write the outputs.

    A checkpoint is saved after every round and every phase (:mod:`edgefuse.app.checkpoint`);
    started again on the same output folder, the run continues after the last completed
    round, and phases already completed are not run again (a phase that did not complete
    runs from its start, the last round's ``after_round`` included).

    On any error the run is recorded as ``failed`` (with what it had so far) and the error
    re-raised; the console summary is printed in every case.

    Raises:
        edgefuse.app.checkpoint.CheckpointMismatch: the output folder holds a checkpoint
            of another config (nothing in the folder is changed).
    """
    rc = context.run_config
    cfg = phases.compose(str(rc.get("experiment", "default")), str(rc.get("overrides", "")))
    ctx, resumed = setup(grid, cfg, output_dir(rc, cfg))
    recorder, active = ctx.recorder, phases.active(cfg)
    done = list(resumed.phases_done) if resumed else []
    first = resumed.round + 1 if resumed else 1
    t_run = time.perf_counter()
    try:
        for phase in active:
            phase.start(ctx)
        ctx.node_ids = wait_for_nodes(ctx.grid, len(cfg.federation.clients), ctx.timeout)
        if resumed:
            checkpoint.restore_rng(resumed)
            record = copy.deepcopy(recorder.results["rounds"][-1])
        for r in range(first, ctx.last_round + 1):
            ctx.round, t_round = r, time.perf_counter()
            record = run_round(ctx, r)
            for phase in active:
                sections, seconds = timed(phase.after_round, ctx, r)
                if sections:
                    record["seconds"][phase.after_round_key or phase.name] = seconds
                    recorder.update(sections)
            record["seconds"]["total"] = time.perf_counter() - t_round
            recorder.add_round(record)
            recorder.save()
            save_checkpoint(ctx, r, done)
            _log_round(r, record["clients"])
        phase_seconds: dict[str, float] = dict(recorder.results["summary"].get("phase_seconds") or {})
        todo = [p for p in active if p.name not in done]
        if resumed and first > ctx.last_round and todo:
            # The rounds were done before the restart: identify the new node ids, then give
            # each phase still to run the last round's after_round again (fusers, installs).
            ctx.round, t_round = ctx.last_round, time.perf_counter()
            identify(ctx, ctx.last_round)
            for phase in todo:
                sections, seconds = timed(phase.after_round, ctx, ctx.last_round)
                if sections:
                    record["seconds"][phase.after_round_key or phase.name] = seconds
                    recorder.update(sections)
        for phase in active:  # the last round's record gets each phase's time
            if phase.name in done:
                log(INFO, "resume: phase %s completed before the restart; not run again", phase.name)
                continue
            sections, phase_seconds[phase.name] = timed(phase.run, ctx)
            record["seconds"][phase.seconds_key or phase.name] = phase_seconds[phase.name]
            record["seconds"]["total"] = time.perf_counter() - t_round
            recorder.update(sections)
            recorder.set_summary({"phase_seconds": phase_seconds})
            recorder.add_round(record)
            recorder.save()
            done.append(phase.name)
            save_checkpoint(ctx, ctx.last_round, done)
        recorder.set_summary({"wall_seconds": time.perf_counter() - t_run,
                              "server_peak_rss_bytes": _peak_rss()})
        recorder.finish("completed")
    except BaseException as e:
        recorder.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        print_summary(recorder.results, out_dir=ctx.out)


def setup(grid: Grid, cfg, out: Path) -> tuple[PhaseContext, checkpoint.Checkpoint | None]:
    """Create the output folder and its first results.json; the run's context (the grid
    wrapped in the outbound-audit tally, a fresh strategy), with the folder's latest
    checkpoint put back into it when there is one (then also returned, else None).

    Raises:
        edgefuse.app.checkpoint.CheckpointMismatch: a checkpoint of another config; raised
            before anything is written.
    """
    out.mkdir(parents=True, exist_ok=True)
    log(INFO, "edgefuse: experiment %s, outputs in %s", cfg.experiment.name, out)
    resumed = checkpoint.latest(out, cfg)
    recorder = RunRecorder(out, OmegaConf.to_container(cfg, resolve=True))
    fed = cfg.federation
    ctx = PhaseContext(cfg=cfg, grid=AuditTally(grid), strategy=GroupedLoRA(cfg), out=out,
                       timeout=float(fed.round_timeout_s), recorder=recorder,
                       last_round=int(fed.num_rounds))
    if resumed is not None:
        checkpoint.restore(resumed, ctx.strategy, recorder, ctx.grid)
        recorder.set_summary({"resumed": [*recorder.results["summary"].get("resumed", []), {
            "after_round": resumed.round, "phases_done": list(resumed.phases_done)}]})
        log(INFO, "resume: continuing after round %d of %d (phases done: %s)", resumed.round,
            ctx.last_round, ", ".join(resumed.phases_done) or "none")
    recorder.save()
    return ctx, resumed


def save_checkpoint(ctx: PhaseContext, round_idx: int, phases_done: list[str]) -> None:
    """Save the run's state after round ``round_idx`` and ``phases_done``
    (:func:`edgefuse.app.checkpoint.save`)."""
    ckpt = checkpoint.capture(ctx.strategy, ctx.recorder, ctx.audit, round_idx, phases_done)
    checkpoint.save(ctx.out, ckpt, ctx.cfg)


def identify(ctx: PhaseContext, r: int) -> None:
    """Ask the nodes not identified yet for their identity (``query.info``)."""
    strategy, grid = ctx.strategy, ctx.grid
    for e in strategy.add_info(grid.send_and_receive(strategy.info_messages(ctx.node_ids),
                                                     timeout=ctx.timeout)):
        log(WARNING, "round %d: node info failed: %s", r, e)


def run_round(ctx: PhaseContext, r: int) -> dict:
    """One federated round: identify new nodes, train, aggregate per model group, save the
    adapters (``outputs.save_adapters``), evaluate. Records and saves the round.

    Returns the round's record (``round``, ``clients``, ``groups``, ``seconds``: ``train``,
    ``aggregate``, ``evaluate``).

    Raises:
        NoClientSucceeded: no client returned a usable update.
    """
    cfg, grid, strategy, timeout = ctx.cfg, ctx.grid, ctx.strategy, ctx.timeout
    n_rounds = ctx.last_round
    t0 = time.perf_counter()
    identify(ctx, r)
    msgs, sent = strategy.configure(r, "train")
    log(INFO, "round %d/%d: training %d clients (%d steps each)", r, n_rounds, len(msgs),
        cfg.training.steps_per_round)
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    t_train = time.perf_counter() - t0
    t1 = time.perf_counter()
    rows, group_rows = strategy.aggregate_train(r, replies, sent)
    t_agg = time.perf_counter() - t1
    if cfg.outputs.save_adapters:
        save_adapters(cfg, strategy, group_rows, ctx.out, r)
    t2 = time.perf_counter()
    msgs, sent = strategy.configure(r, "evaluate")
    log(INFO, "round %d/%d: aggregated %s in %.2f s; evaluating", r, n_rounds,
        ", ".join(f"{g['model']} ({g['method']})" for g in group_rows), t_agg)
    strategy.aggregate_evaluate(rows, grid.send_and_receive(msgs, timeout=timeout), sent)
    seconds = {"train": t_train, "aggregate": t_agg, "evaluate": time.perf_counter() - t2}
    record = {"round": r, "clients": rows, "groups": group_rows, "seconds": seconds}
    ctx.recorder.add_round(record)
    ctx.recorder.save()
    return record


def timed(fn, *args):
    """``(fn(*args), wall seconds it took)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


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
