"""Fuser training throughput, before and after the prompt-cache store and batching, in one run.

Same pair, same examples, same fuser, same threads; three ways to run the training steps:

- ``before``: what fuser training did until now: every example of every step prefills the
  receiver and the sharer again (full logits), one example per forward pass;
- ``batched``: the prefills still computed at every step, ``micro_batch`` examples of
  similar length per forward pass, batches grouped by length;
- ``cached``: batched, and the prompt caches read from a warm :class:`PrefillStore` (both
  models are frozen, so later epochs, the controls and other pairs with the same model
  read what the first pass wrote). The one-time cost of filling the store is reported
  beside it (``fill_s_per_example``).

    python bench/bench_fuser_throughput.py                     # SmolLM2 <- Qwen2.5-0.5B
    python bench/bench_fuser_throughput.py --examples 32 --quick

Writes ``bench/results/bench_fuser_throughput.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.config import compose  # noqa: E402
from edgefuse.io import atomic_write_bytes, atomic_write_json  # noqa: E402
from edgefuse.models import load_model  # noqa: E402
from edgefuse.c2c.examples import build_pair_examples  # noqa: E402
from edgefuse.c2c.fuser import C2CFuser, kv_spec_from_config  # noqa: E402
from edgefuse.c2c.hub import fuser_config  # noqa: E402
from edgefuse.c2c.prefill import PrefillStore, Prefiller  # noqa: E402
from edgefuse.c2c.train import pair_loss, train_fuser  # noqa: E402
from edgefuse.eval.splits import fuser_training_rows  # noqa: E402


def _old_steps(fuser, receiver, sharer, examples, steps: int, batch_size: int) -> float:
    """The training loop as it was: per example, both prefills + fuse + forward + backward."""
    opt = torch.optim.AdamW(fuser.parameters(), lr=1e-3)
    fuser.train()
    t0 = time.perf_counter()
    for step in range(steps):
        batch = examples[step * batch_size:(step + 1) * batch_size]
        total = sum(ex.num_tokens for ex in batch)
        opt.zero_grad(set_to_none=True)
        for ex in batch:
            loss, n = pair_loss(fuser, receiver, sharer, ex)
            (loss * (n / max(total, 1))).backward()
        torch.nn.utils.clip_grad_norm_(list(fuser.parameters()), 1.0)
        opt.step()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--receiver", default="smollm2-135m")
    ap.add_argument("--sharer", default="qwen2.5-coder-0.5b")
    ap.add_argument("--examples", type=int, default=64, help="examples per way (a multiple of --batch-size)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--quick", action="store_true", help="16 examples per way")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_fuser_throughput.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.examples = 16
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    n = max(args.batch_size, args.examples // args.batch_size * args.batch_size)
    steps = n // args.batch_size
    cfg = compose("default", [f"c2c.train.data=[{{source: dolly_public, n: {n}}}]"])
    rows = fuser_training_rows(cfg, int(cfg.seed))
    receiver, r_tok = load_model(args.receiver, root=cfg.paths.cache_dir)
    sharer, s_tok = load_model(args.sharer, root=cfg.paths.cache_dir)
    for m in (receiver, sharer):
        m.eval()
        m.requires_grad_(False)
    examples = build_pair_examples(rows, r_tok, s_tok, args.max_seq_len)[:n]
    n, steps = len(examples) // args.batch_size * args.batch_size, len(examples) // args.batch_size
    examples = examples[:n]
    fcfg = fuser_config(cfg)

    def fresh():
        torch.manual_seed(0)
        return C2CFuser(kv_spec_from_config(receiver.config), kv_spec_from_config(sharer.config), fcfg)

    report = {"receiver": args.receiver, "sharer": args.sharer, "examples": n, "steps": steps,
              "batch_size": args.batch_size, "micro_batch": args.micro_batch, "threads": threads,
              "max_seq_len": args.max_seq_len,
              "mean_prompt_tokens": sum(len(e.receiver_prompt_ids) for e in examples) / n,
              "mean_response_tokens": sum(e.num_tokens for e in examples) / n,
              "cpu": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available()}
    kw = dict(steps=steps, batch_size=args.batch_size, lr=1e-3, seed=0, progress=False)
    print(f"[bench] {n} examples, {steps} steps of {args.batch_size}, {threads} threads", flush=True)

    before_s = _old_steps(fresh(), receiver, sharer, examples, steps, args.batch_size)
    report["before_examples_per_s"] = n / before_s
    print(f"[bench] before: {n / before_s:.2f} examples/s", flush=True)

    t0 = time.perf_counter()
    train_fuser(fresh(), receiver, sharer, examples, micro_batch=args.micro_batch, length_group=16, **kw)
    report["batched_examples_per_s"] = n / (time.perf_counter() - t0)
    print(f"[bench] batched, prefills every step: {report['batched_examples_per_s']:.2f} examples/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        store = PrefillStore(tmp)
        pre = {"receiver_prefill": Prefiller(receiver, "r", store), "sharer_prefill": Prefiller(sharer, "s", store)}
        t0 = time.perf_counter()
        for ex in examples:
            pre["receiver_prefill"](ex.receiver_prompt_ids)
            pre["sharer_prefill"](ex.sharer_prompt_ids)
        report["fill_s_per_example"] = (time.perf_counter() - t0) / n
        report["store_bytes_per_example"] = sum(f.stat().st_size for f in Path(tmp).rglob("*.safetensors")) / n
        t0 = time.perf_counter()
        train_fuser(fresh(), receiver, sharer, examples, micro_batch=args.micro_batch, length_group=16,
                    **pre, **kw)
        report["cached_examples_per_s"] = n / (time.perf_counter() - t0)
    report["speedup_batched"] = report["batched_examples_per_s"] / report["before_examples_per_s"]
    report["speedup_cached"] = report["cached_examples_per_s"] / report["before_examples_per_s"]
    report["target_speedup"] = 10.0
    report["target_met"] = report["speedup_cached"] >= 10.0
    print(f"[bench] cached + batched: {report['cached_examples_per_s']:.2f} examples/s "
          f"({report['speedup_cached']:.1f}x before; store filled at {report['fill_s_per_example']:.2f} s/example, "
          f"{report['store_bytes_per_example'] / 1e6:.1f} MB/example)", flush=True)
    out = Path(args.out).resolve()
    atomic_write_json(out, report)
    _plot(report, out.with_suffix(".png"))
    print(f"[bench] wrote {out}")
    return 0


def _plot(report: dict, path: Path) -> None:
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), constrained_layout=True)
    ax = fig.subplots()
    names = ["before", "batched", "cached + batched"]
    vals = [report["before_examples_per_s"], report["batched_examples_per_s"], report["cached_examples_per_s"]]
    bars = ax.bar(names, vals, color=["grey", "tab:blue", "tab:green"])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}\n({v / vals[0]:.1f}x)", ha="center", va="bottom")
    ax.set_ylabel("training examples / s")
    ax.set_title(f"fuser training {report['receiver']} <- {report['sharer']}, {report['threads']} threads")
    ax.set_ylim(0, max(vals) * 1.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
