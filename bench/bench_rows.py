"""What a block of rows costs the target on this CPU: one cached forward of n new rows.

Speculative decoding pays, per verified block of γ drafts, one forward of γ + 1 rows at the
cloud (``spec_*``: the whole target; ``split_spec``: its middle layers). On a GPU that cost
is nearly flat in the rows; on a CPU the matrix kernels are not smooth in the rows, and the
γ controller (:class:`edgefuse.cloud.speculative.GammaController`, fed the round trips it
measures per γ) needs to find the steps. This times the target's decoder body (no LM
head) over ``n`` new rows on top of a ``--context``-token KV cache, for each n, with one
torch thread (as the service runs in the benchmarks), the median of ``--repeats`` runs after
one warm-up; and the same for the middle layers of the default split (k = m = 2).

    python bench/bench_rows.py                # qwen2.5-coder-1.5b, n = 1..8, 12, 16; ~2 min
    python bench/bench_rows.py --quick        # the tiny Qwen2, seconds: the pipeline only

Writes ``bench/results/bench_rows.json`` and a PNG beside it (``--quick``: ``bench_rows_quick.*``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.cloud import split as S  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.cloud.target import cache_from_layers, cache_layers  # noqa: E402
from edgefuse.models import ModelFetchError, ModelSpecError, load_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
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


@torch.no_grad()
def time_rows(body, embeds: bool, hidden: int, vocab: int, context: int, rows: list[int],
              repeats: int) -> dict[int, float]:
    """Median ms of one forward of ``n`` new rows after ``context`` cached positions, per n."""
    g = torch.Generator().manual_seed(0)
    if embeds:
        prefix = {"inputs_embeds": torch.randn(1, context, hidden, generator=g) * 0.1}
    else:
        prefix = {"input_ids": torch.randint(0, vocab, (1, context), generator=g)}
    out = body(**prefix, use_cache=True)
    layers = cache_layers(out)
    res = {}
    for n in rows:
        new = ({"inputs_embeds": torch.randn(1, n, hidden, generator=g) * 0.1} if embeds
               else {"input_ids": torch.randint(0, vocab, (1, n), generator=g)})
        pos = torch.arange(context, context + n).unsqueeze(0)
        ts = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = cache_from_layers([(k.clone(), v.clone()) for k, v in layers])
            t0 = time.perf_counter()
            body(**new, position_ids=pos, cache=cache, use_cache=True)
            ts.append(1000 * (time.perf_counter() - t0))
        res[n] = statistics.median(ts[1:])
        print(f"  {n:>3} rows: {res[n]:7.1f} ms", flush=True)
    return res


def plot(result: dict, path: Path) -> Path:
    from edgefuse.results.plotting import colour, new_figure, save_png

    fig = new_figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, key) in enumerate((("whole body", "body_ms"), ("split middle", "middle_ms"))):
        xs = sorted(int(n) for n in result[key])
        ax.plot(xs, [result[key][str(n)] / result[key][str(xs[0])] for n in xs], "o-",
                color=colour(i, 2), label=name)
    ax.set_xlabel("new rows in one forward (γ + 1)")
    ax.set_ylabel("cost / cost of one row")
    ax.set_title(f"{result['model']}, {result['threads']} thread(s), {result['context']} cached tokens", fontsize=9)
    ax.legend(fontsize="small")
    return save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
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
    print(f"{args.model}: whole decoder body", flush=True)
    body_ms = time_rows(model.get_decoder(), False, cfg.hidden_size, cfg.vocab_size, args.context,
                        args.rows, args.repeats)
    print(f"middle layers of k={k}, m={m}", flush=True)
    middle = S.split_model(model, k, m).middle
    middle_ms = time_rows(middle, True, cfg.hidden_size, cfg.vocab_size, args.context, args.rows, args.repeats)
    one_b, one_m = body_ms[args.rows[0]], middle_ms[args.rows[0]]
    result = {
        "model": args.model, "threads": args.threads, "context": args.context, "repeats": args.repeats,
        "split": [k, m], "rows": args.rows,
        "body_ms": {str(n): v for n, v in body_ms.items()},
        "middle_ms": {str(n): v for n, v in middle_ms.items()},
        "body_ratio_to_first": {str(n): v / one_b for n, v in body_ms.items()},
        "middle_ratio_to_first": {str(n): v / one_m for n, v in middle_ms.items()},
        "wall_seconds": time.perf_counter() - t0, "load_avg": list(os.getloadavg()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "python bench/bench_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    png = plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
