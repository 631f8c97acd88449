"""Train one Cache-to-Cache fuser on real models and compare held-out loss with and without it.

The receiver and sharer are frozen; the fuser trains on Dolly's public split (which no
client holds) and is scored on other public examples: receiver alone vs receiver reading
the sharer's fused prompt cache. Single-threaded torch, so the figure is comparable run to
run on a busy machine.

    python bench/bench_fuser_pair.py                       # SmolLM2 <- Qwen2.5-0.5B, 60 steps
    python bench/bench_fuser_pair.py --quick               # 15 steps, 20 held-out examples
    python bench/bench_fuser_pair.py --receiver gemma3-270m --sharer smollm2-135m --out x.json

Writes JSON to ``--out`` and a PNG of the training loss beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse import data  # noqa: E402
from edgefuse.config import compose  # noqa: E402
from edgefuse.models import load_model  # noqa: E402
from edgefuse.io import atomic_write_bytes, atomic_write_json  # noqa: E402
from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config  # noqa: E402
from edgefuse.c2c.examples import build_pair_examples  # noqa: E402
from edgefuse.c2c.train import evaluate_pair, train_fuser  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--receiver", default="smollm2-135m")
    ap.add_argument("--sharer", default="qwen2.5-coder-0.5b")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-examples", type=int, default=250)
    ap.add_argument("--eval-examples", type=int, default=50)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="15 steps, 20 held-out examples")
    ap.add_argument("--control", choices=["none", "zero", "shuffled"], default="none",
                    help="zero: the fuser sees an all-zero sharer cache, shuffled: another prompt's "
                         "(FuserConfig.sharer_control), so a gain is the fuser's own capacity, not "
                         "information from the sharer; bench/bench_c2c_learning.py runs all three")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_fuser_pair.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_examples = 15, 20
    torch.set_num_threads(1)
    cfg = compose("default", f"data.max_seq_len={args.max_seq_len}")  # paths: resolve_paths
    public = data.public_split(cfg.data, int(cfg.seed))
    n_train, n_eval = args.train_examples, args.eval_examples
    rows = [public[i] for i in range(min(len(public), n_train + n_eval))]

    receiver, r_tok = load_model(args.receiver, root=cfg.paths.cache_dir)
    sharer, s_tok = load_model(args.sharer, root=cfg.paths.cache_dir)
    train = build_pair_examples(rows[:n_train], r_tok, s_tok, args.max_seq_len)
    held = build_pair_examples(rows[n_train:], r_tok, s_tok, args.max_seq_len)
    fcfg = FuserConfig(gate_init=1.0, sharer_control=args.control)
    fuser = C2CFuser(kv_spec_from_config(receiver.config), kv_spec_from_config(sharer.config), fcfg)
    alone = evaluate_pair(fuser, receiver, sharer, held, gate="off")
    t0 = time.perf_counter()
    stats = train_fuser(fuser, receiver, sharer, train, steps=args.steps,
                        batch_size=args.batch_size, lr=args.lr, seed=int(cfg.seed))
    train_s = time.perf_counter() - t0
    fused = evaluate_pair(fuser, receiver, sharer, held, gate="on")
    report = {
        "receiver": args.receiver, "sharer": args.sharer, "control": args.control,
        "fuser_config": fcfg.to_dict(),
        "fuser_params": fuser.num_parameters(), "fuser_bytes": fuser.nbytes(),
        "receiver_params": sum(p.numel() for p in receiver.parameters()),
        "train_examples": len(train), "eval_examples": len(held), "steps": args.steps,
        "batch_size": args.batch_size, "lr": args.lr, "train_seconds": train_s,
        "seconds_per_step": train_s / args.steps, "train_losses": stats["losses"],
        "eval_loss_alone": alone["loss"], "eval_loss_fused": fused["loss"],
        "fused_over_alone": fused["loss"] / alone["loss"],
    }
    out = Path(args.out).resolve()
    atomic_write_json(out, report)
    _plot(report, out.with_suffix(".png"))
    print(f"[bench] {args.receiver} <- {args.sharer} (control: {args.control}): held-out loss alone {alone['loss']:.4f}, "
          f"fused {fused['loss']:.4f} ({report['fused_over_alone']:.3f}x); "
          f"{report['seconds_per_step']:.1f} s/step; fuser {report['fuser_params']:,} params")
    print(f"[bench] wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(report: dict, path: Path) -> None:
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), constrained_layout=True)
    ax = fig.subplots()
    ax.plot(range(1, len(report["train_losses"]) + 1), report["train_losses"], label="train (batch)")
    ax.axhline(report["eval_loss_alone"], ls="--", color="grey", label="held-out: receiver alone")
    ax.axhline(report["eval_loss_fused"], ls="-", color="tab:green", label="held-out: with fuser")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"C2C fuser {report['receiver']} <- {report['sharer']}")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
