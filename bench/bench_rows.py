"""What a block of rows costs the target on this CPU: one cached forward of n new rows.

Speculative decoding pays, per verified block of γ drafts, one forward of γ + 1 rows at the
cloud (``spec_*``: the whole target; ``split_spec``: its middle layers). On a GPU that cost
is nearly flat in the rows; on a CPU the matrix kernels are not smooth in the rows, and the
γ controller (:class:`edgefuse.cloud.speculative.GammaController`, fed the round trips it
measures per γ) needs to find the steps, and the service pads a forward to the cheapest
row count at or above its own (:mod:`edgefuse.cloud.rows`, calibrated the same way at
start). This times, over ``n`` new rows on top of a ``--context``-token KV cache, for each
n: the whole model with its LM head (what a VERIFY runs), its decoder body, and the middle
layers of the default split (k = m = 2), with one torch thread (as the service runs in the
benchmarks), the median of ``--repeats`` runs after one warm-up; and what the calibrated
padding makes of the first curve.

    python bench/bench_rows.py                # qwen2.5-coder-1.5b, n = 1..32; ~6 min
    python bench/bench_rows.py --quick        # the tiny Qwen2, seconds: the pipeline only

Writes ``bench/results/bench_rows.json`` and a PNG beside it (``--quick``: ``bench_rows_quick.*``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.cloud import split as S  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.cloud.rows import CALIBRATION_ROWS, RowPadding, time_rows  # noqa: E402
from edgefuse.models import ModelFetchError, ModelSpecError, load_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", type=int, nargs="+", default=list(CALIBRATION_ROWS))
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--split", type=int, nargs=2, default=None, metavar=("K", "M"),
                   help="the cut whose middle layers are timed too (default 2 2; --quick 1 0)")
    p.add_argument("--quick", action="store_true", help="the tiny Qwen2, 3 repeats")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.repeats, args.context = "tiny-qwen2", 3, 16
    if args.split is None:
        args.split = [1, 0] if args.quick else [2, 2]
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / f"bench_rows{'_quick' if args.quick else ''}.json")
    return args


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour, new_figure, save_png

    fig = new_figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    curves = (("whole model + LM head", "model_ms"), ("after calibrated padding", "padded_model_ms"),
              ("decoder body", "body_ms"), ("split middle", "middle_ms"))
    base = result["model_ms"][str(min(int(n) for n in result["model_ms"]))]
    for i, (name, key) in enumerate(curves):
        xs = sorted(int(n) for n in result[key])
        ref = base if key == "padded_model_ms" else result[key][str(xs[0])]
        ax.plot(xs, [result[key][str(n)] / ref for n in xs], "o-" if i != 1 else "s--",
                color=colour(i, len(curves)), label=name)
    ax.set_xlabel("new rows in one forward (γ + 1)")
    ax.set_ylabel("cost / cost of one row")
    ax.set_title(f"{result['model']}, {result['threads']} thread(s), {result['context']} cached tokens", fontsize=9)
    ax.legend(fontsize="small")
    return save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    load_before = list(os.getloadavg())
    try:
        model, _ = load_model(args.model)
    except (ModelSpecError, ModelFetchError, OSError) as e:
        print(f"bench_rows: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    cfg = model.config
    k, m = args.split
    try:
        S.SplitSpec(k, m).check(int(cfg.num_hidden_layers), int(cfg.hidden_size))
    except ValueError as e:
        print(f"bench_rows: --split: {e}", file=sys.stderr)
        return 2
    def progress(n, ms):
        print(f"  {n:>3} rows: {ms:7.1f} ms", flush=True)

    timed = {}
    for key, label, body, embeds, output in (
            ("model_ms", "the whole model with its LM head (what a VERIFY runs)", model, False, "logits"),
            ("body_ms", "the decoder body", model.get_decoder(), False, None),
            ("middle_ms", f"the middle layers of k={k}, m={m}", S.split_model(model, k, m).middle, True, None)):
        print(f"{args.model}: {label}", flush=True)
        timed[key] = time_rows(body, embeds=embeds, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                               context=args.context, rows=args.rows, repeats=args.repeats, output=output,
                               on_row=progress)
    result = {
        "model": args.model, "threads": args.threads, "context": args.context, "repeats": args.repeats,
        "split": [k, m], "rows": args.rows,
        "load_avg_before": load_before,
        "wall_seconds": time.perf_counter() - t0, "load_avg": list(os.getloadavg()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "python bench/bench_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    for key, ms in timed.items():
        first = ms[args.rows[0]]
        result[key] = {str(n): v for n, v in ms.items()}
        result[key.replace("_ms", "_ratio_to_first")] = {str(n): v / first for n, v in ms.items()}
    # what the calibrated padding makes of it: each n padded to the cheapest measured count >= n
    pad = RowPadding.from_costs(timed["model_ms"])
    result["padding"] = {str(n): pad.rows(n) for n in range(1, max(args.rows) + 1)}
    result["padded_model_ms"] = {str(n): timed["model_ms"][pad.rows(n)] for n in args.rows}
    print("padding (rows -> padded to): " + ", ".join(f"{n}->{pad.rows(n)}" for n in args.rows
                                                       if pad.rows(n) != n), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    png = plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
