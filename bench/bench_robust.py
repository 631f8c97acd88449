"""Measure robust aggregation against one malicious client of four, on real LoRA updates.

Four SmolLM2-135M clients train LoRA adapters on their Dolly partitions (category split of
the data mirror, :func:`edgefuse.data.client_split`) for two rounds: round 1 from the seeded
initial adapter, round 2 from the round-1 FedAvg aggregate (the adapter the server sent).
Client 3 is then made malicious, and each aggregation rule (``none`` = FedAvg,
``trimmed_mean``, ``median``; :func:`edgefuse.aggregation.aggregate_group`) aggregates the
four updates, side by side with the honest-only aggregate (FedAvg of clients 0-2):

* ``scaled``: client 3 sends ``sent + c·(own − sent)`` (its round step boosted), ``c`` chosen
  so that the largest of its update norm and both cross norms with the sent adapter is
  0.99 × ``privacy.max_update_norm``: it passes every server check.
* ``sign_flip``: ``sent − c·(own − sent)``, scaled to the bound the same way.
* ``a0_huge_b``: ``A = 0`` with a huge ``B``; in round 2 the server's check against the sent
  adapter must refuse it (recorded); in round 1 (no reference yet) it passes, so it is
  aggregated with round 1's honest updates, which is where FedAvg can only clip it.
* ``no_attack``: client 3 honest: the price of each rule without an attacker.

Reported per (attack, rule): ``‖ΔW(aggregate) − ΔW(honest-only)‖_F / ‖ΔW(honest-only)‖_F``
(all modules together), and the held-out response loss of the base model with that
aggregate on the same held-out rows (public Dolly rows no client holds), per row, with the
mean paired difference to the honest-only aggregate and its 95 % percentile-bootstrap
interval (:func:`edgefuse.eval.stats.paired_difference`). Both ``training.equal_rank``
modes are measured (``fedavg``: rules on ``A`` and ``B``; ``flexlora``: on the products;
its held-out loss only with ``--flexlora-loss``). Round 1 shows only ``a0_huge_b``.
Nothing is timed.

    python bench/bench_robust.py            # ~12 min on 2 busy CPU cores
    python bench/bench_robust.py --quick    # 2 steps, 16 held-out rows: a smoke check

Writes ``bench/results/bench_robust.json`` and ``bench/results/bench_robust.png``.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.results.plotting import colour, new_figure, no_data, save_png  # noqa: E402

RULES = ("none", "trimmed_mean", "median")
ATTACKS = ("no_attack", "scaled", "sign_flip", "a0_huge_b")
MALICIOUS = 3


def per_row_loss(model, rows: list[dict], pad_id: int, batch_size: int = 8) -> list[float]:
    """Mean cross-entropy per response token of each row (nats/token), one value per row."""
    import torch

    from edgefuse.data import collate

    out = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = collate(rows[i:i + batch_size], pad_id)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            ce = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
            mask = labels != -100
            out += ((ce * mask).sum(1) / mask.sum(1)).tolist()
    return out


def adapter_dw(state: dict, rank: int, alpha: float) -> dict[str, np.ndarray]:
    """module -> ``alpha / rank · B A`` (float64)."""
    from edgefuse.aggregation import A_SUFFIX, B_SUFFIX, module_shapes

    return {m: alpha / rank * state[m + B_SUFFIX].astype(np.float64) @ state[m + A_SUFFIX]
            for m in module_shapes(state)}


def relative_distance(state: dict, ref: dict, rank: int, alpha: float) -> float:
    """``‖ΔW(state) − ΔW(ref)‖_F / ‖ΔW(ref)‖_F`` over all modules."""
    a, b = adapter_dw(state, rank, alpha), adapter_dw(ref, rank, alpha)
    num = sum(float(((a[m] - b[m]) ** 2).sum()) for m in b)
    return math.sqrt(num / sum(float((b[m] ** 2).sum()) for m in b))


def boosted(own: dict, sent: dict, sign: float, bound: float, rank: int, alpha: float) -> tuple[dict, float]:
    """``sent + sign·c·(own − sent)`` with the largest ``c`` (bisection) whose update norm and
    cross norms with ``sent`` are all at most ``0.99 · bound``; returns ``(state, c)``."""
    from edgefuse.aggregation import cross_norm, update_norm

    def make(c):
        return {k: (sent[k] + sign * c * (own[k] - sent[k])).astype(np.float32) for k in own}

    def worst(c):
        st = make(c)
        return max(update_norm(st, rank, alpha), cross_norm(st, sent, rank, alpha),
                   cross_norm(sent, st, rank, alpha))

    target = 0.99 * bound
    lo, hi = 0.0, 1.0
    while worst(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            raise RuntimeError("the update does not grow with c: cannot reach the bound")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if worst(mid) <= target else (lo, mid)
    return make(lo), lo


def a0_huge_b(sent: dict, scale: float = 1e3) -> dict:
    """``A = 0`` and ``B`` full of ``scale``: its own ``‖s B A‖`` is 0."""
    from edgefuse.aggregation import A_SUFFIX

    return {k: (np.zeros_like(v) if k.endswith(A_SUFFIX) else np.full_like(v, scale))
            for k, v in sent.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps per client per round")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (on a shared 2-core machine one is several times faster)")
    ap.add_argument("--flexlora-loss", action="store_true",
                    help="also score the flexlora aggregates' held-out loss (default: distances only)")
    ap.add_argument("--eval-n", type=int, default=64, help="held-out rows (public Dolly)")
    ap.add_argument("--max-norm", type=float, default=None,
                    help="the update-norm bound (default: privacy.max_update_norm of the config)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 steps, 16 held-out rows")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_robust.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_n = 2, 16
    try:
        report = run(args)
    except Exception as e:  # one clear line, no traceback
        print(f"bench_robust: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    print_table(report)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def run(args) -> dict:
    import torch

    from edgefuse import data as data_mod
    from edgefuse.aggregation import (ClientUpdate, MalformedUpdateError, aggregate_group,
                                      update_norm, validate_update)
    from edgefuse.config import compose, lora_targets
    from edgefuse.eval.stats import paired_difference
    from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state
    from edgefuse.models import load_model
    from edgefuse.training import train_steps

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    cfg = compose("default", [f"data.max_seq_len={args.max_seq_len}"])
    bound = float(args.max_norm if args.max_norm is not None else cfg.privacy.max_update_norm)
    alpha, rank, n_clients = float(cfg.training.lora_alpha), int(args.rank), 4
    model, tok = load_model(args.model, root=cfg.paths.cache_dir)
    peft = attach_lora(model, rank=rank, alpha=alpha, dropout=float(cfg.training.lora_dropout),
                       target_modules=lora_targets(cfg, args.model), seed=int(cfg.seed))
    init = get_adapter_state(peft)
    pad = tok.pad_token_id
    print(f"model loaded ({time.perf_counter() - t_start:.0f} s)", flush=True)
    train_rows = []
    for p in range(n_clients):
        train_ds, _ = data_mod.client_split(cfg.data, p, n_clients, int(cfg.seed))
        train_rows.append(data_mod.tokenize_dataset(train_ds.select(range(min(len(train_ds), 256))),
                                                    tok, args.max_seq_len))
    public = data_mod.public_split(cfg.data, int(cfg.seed))
    eval_rows = data_mod.tokenize_dataset(public.select(range(min(len(public), 2 * args.eval_n))),
                                          tok, args.max_seq_len)[:args.eval_n]
    print(f"data ready: {[len(r) for r in train_rows]} training rows, {len(eval_rows)} held-out "
          f"({time.perf_counter() - t_start:.0f} s)", flush=True)

    def train_round(start: dict, round_idx: int) -> tuple[list[dict], list[float]]:
        states, losses = [], []
        for p in range(n_clients):
            set_adapter_state(peft, start)
            m = train_steps(peft, train_rows[p], pad, steps=args.steps, batch_size=args.batch_size,
                            lr=args.lr, max_grad_norm=float(cfg.training.max_grad_norm),
                            seed=int(cfg.seed) + p, round_idx=round_idx)
            states.append(get_adapter_state(peft))
            losses.append(m["train_loss"])
            print(f"round {round_idx} client {p}: train loss {m['train_loss']:.3f} "
                  f"({m['seconds']:.0f} s)", flush=True)
        return states, losses

    def upd(p, st):
        return ClientUpdate(p, args.model, rank, alpha, args.steps * args.batch_size, st)

    r1, loss1 = train_round(init, 1)
    sent = aggregate_group([upd(p, s) for p, s in enumerate(r1)], max_norm=bound).global_state
    r2, loss2 = train_round(sent, 2)

    losses_cache: dict[bytes, list[float]] = {}

    def held_out(state: dict | None) -> list[float]:
        if state is None:
            with peft.disable_adapter():
                return per_row_loss(peft, eval_rows, pad)
        key = b"".join(np.ascontiguousarray(state[k]).tobytes() for k in sorted(state))
        if key not in losses_cache:
            set_adapter_state(peft, state)
            losses_cache[key] = per_row_loss(peft, eval_rows, pad)
        return losses_cache[key]

    base = held_out(None)
    rows, refused = [], []
    for equal_rank in ("fedavg", "flexlora"):
        for round_idx, states, ref in ((2, r2, sent), (1, r1, None)):
            honest_ups = [upd(p, s) for p, s in enumerate(states[:MALICIOUS])]
            honest = aggregate_group(honest_ups, max_norm=bound, equal_rank=equal_rank).global_state
            scored = equal_rank == "fedavg" or args.flexlora_loss
            honest_loss = held_out(honest) if scored else None
            attacks = {"a0_huge_b": a0_huge_b(ref if ref is not None else init)}
            if round_idx == 2:  # round 1 only shows the attack that needs no reference
                attacks["no_attack"] = states[MALICIOUS]
                attacks["scaled"], c_up = boosted(states[MALICIOUS], ref, 1.0, bound, rank, alpha)
                attacks["sign_flip"], c_flip = boosted(states[MALICIOUS], ref, -1.0, bound, rank, alpha)
            for attack, bad_state in attacks.items():
                bad = upd(MALICIOUS, bad_state)
                try:
                    validate_update(bad, args.model, None, max_norm=bound, reference=ref)
                except MalformedUpdateError as e:
                    refused.append({"round": round_idx, "attack": attack, "equal_rank": equal_rank,
                                    "reason": str(e)})
                    continue
                for rule in RULES:
                    res = aggregate_group(honest_ups + [bad], max_norm=bound, equal_rank=equal_rank,
                                          robust=rule)
                    loss = held_out(res.global_state) if scored else None
                    diff = (paired_difference(loss, honest_loss, seed=args.seed).to_dict("loss_minus_honest_only")
                            if scored else {})
                    row = {"equal_rank": equal_rank, "round": round_idx, "attack": attack, "rule": rule,
                           "trimmed_per_end": res.info["trimmed_per_end"],
                           "malicious_update_norm": update_norm(bad_state, rank, alpha),
                           "aggregate_norm": update_norm(res.global_state, rank, alpha),
                           "honest_only_norm": update_norm(honest, rank, alpha),
                           "clipped": (res.info.get("clipped") or {}).get(rank),
                           "relative_distance": relative_distance(res.global_state, honest, rank, alpha),
                           "heldout_loss": float(np.mean(loss)) if scored else None,
                           "honest_only_heldout_loss": float(np.mean(honest_loss)) if scored else None,
                           **diff}
                    if attack in ("scaled", "sign_flip"):
                        row["boost"] = c_up if attack == "scaled" else c_flip
                    rows.append(row)
                    print(f"{equal_rank} r{round_idx} {attack:10s} {rule:12s} rel {row['relative_distance']:.3f} "
                          f"loss {row['heldout_loss']} (honest {row['honest_only_heldout_loss']}) "
                          f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    if not any(r["round"] == 2 and r["attack"] == "a0_huge_b" for r in refused):
        raise RuntimeError("the A = 0 / huge-B update was not refused in round 2")
    return {
        "bench": "robust aggregation, 1 malicious client of 4",
        "command": " ".join(["python", "bench/bench_robust.py", *sys.argv[1:]]),
        "settings": {"model": args.model, "rank": rank, "alpha": alpha, "clients": n_clients,
                     "malicious": MALICIOUS, "steps_per_round": args.steps,
                     "batch_size": args.batch_size, "lr": args.lr, "max_seq_len": args.max_seq_len,
                     "heldout_rows": len(eval_rows), "heldout_source": "public Dolly rows (no client's)",
                     "max_update_norm": bound, "trim_fraction": 0.25, "seed": args.seed,
                     "partitioning": str(cfg.data.partitioning)},
        "train_loss": {"round1": loss1, "round2": loss2},
        "base_heldout_loss": float(np.mean(base)),
        "rows": rows,
        "refused": refused,
        "seconds": time.perf_counter() - t_start,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
    }


def print_table(report: dict) -> None:
    print(f"{'equal_rank':10s} {'rd':>2s} {'attack':10s} {'rule':12s} {'rel dist':>9s} "
          f"{'loss':>7s} {'Δ vs honest [95% CI]':>28s}")
    for r in report["rows"]:
        loss = "" if r["heldout_loss"] is None else (
            f"{r['heldout_loss']:7.3f} {r['loss_minus_honest_only']:+8.3f} "
            f"[{r['loss_minus_honest_only_ci95_low']:+.3f}, {r['loss_minus_honest_only_ci95_high']:+.3f}]")
        print(f"{r['equal_rank']:10s} {r['round']:>2d} {r['attack']:10s} {r['rule']:12s} "
              f"{r['relative_distance']:9.3f} {loss}")
    for r in report["refused"]:
        print(f"refused: {r['equal_rank']} round {r['round']} {r['attack']}: {r['reason']}")


def plot(report: dict, path: Path) -> Path:
    """Two panels per equal-rank mode: relative distance to honest-only (log), and the paired
    held-out loss difference with its 95 % interval; bars grouped by attack, one per rule."""
    modes = sorted({r["equal_rank"] for r in report["rows"]}, key=["fedavg", "flexlora"].index)
    fig = new_figure(figsize=(12, 3.6 * len(modes)))
    axes = fig.subplots(len(modes), 2, squeeze=False)
    for i, mode in enumerate(modes):
        rows = [r for r in report["rows"] if r["equal_rank"] == mode]
        groups = sorted({(r["round"], r["attack"]) for r in rows}, key=lambda g: (-g[0], ATTACKS.index(g[1])))
        x = np.arange(len(groups))
        for j, rule in enumerate(RULES):
            cell = {(r["round"], r["attack"]): r for r in rows if r["rule"] == rule}
            dist = [cell[g]["relative_distance"] for g in groups]
            kw = dict(width=0.27, color=colour(j, len(RULES)), label="fedavg (none)" if rule == "none" else rule)
            axes[i][0].bar(x + (j - 1) * 0.27, dist, **kw)
            if any(cell[g]["heldout_loss"] is None for g in groups):
                continue
            d = np.array([cell[g]["loss_minus_honest_only"] for g in groups])
            lo = d - np.array([cell[g]["loss_minus_honest_only_ci95_low"] for g in groups])
            hi = np.array([cell[g]["loss_minus_honest_only_ci95_high"] for g in groups]) - d
            axes[i][1].bar(x + (j - 1) * 0.27, d, yerr=[lo, hi], capsize=2, **kw)
        labels = [f"r{rd} {a}" for rd, a in groups]
        for ax in axes[i]:
            ax.set_xticks(x, labels, fontsize=8)
        axes[i][0].set_yscale("log")
        axes[i][0].set_ylabel("‖ΔW − ΔW_honest‖ / ‖ΔW_honest‖")
        axes[i][0].set_title(f"{mode}: distance to the honest-only aggregate")
        axes[i][0].legend(fontsize=8)
        if all(r["heldout_loss"] is None for r in rows):
            axes[i][1].set_yticks([])
            no_data(axes[i][1], "held-out loss (distances only; --flexlora-loss scores it)")
            continue
        axes[i][1].set_ylabel("held-out loss − honest-only (nats/token)")
        axes[i][1].set_yscale("symlog", linthresh=0.01)
        axes[i][1].axhline(0, color="grey", lw=0.8)
        axes[i][1].set_title(f"{mode}: paired loss difference, 95 % CI (n={report['settings']['heldout_rows']})")
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
