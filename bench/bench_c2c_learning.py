"""Does a C2C fuser carry the sharer's knowledge? Learning curves against two controls.

For each pair (sharer -> receiver), three fusers start from the same weights and train in
lockstep on the same public examples with the same budget:

- ``c2c``: fed the sharer's own prompt cache;
- ``zero``: fed an all-zero sharer cache (what it learns is its own capacity, a prefix);
- ``shuffled``: fed another prompt's sharer cache (real sharer statistics, wrong prompt).

At log-spaced numbers of training examples seen, each is scored on the same held-out items
(public Dolly evaluation rows and GSM8K test questions with their reference answers) by the
receiver's mean NLL per response token; the receiver alone and text-to-text (the sharer's
greedy answer in the receiver's context) are scored once on the same items. Every
comparison is paired over the items with a 95 % paired-bootstrap interval
(:func:`edgefuse.eval.stats.paired_difference`). Responses are cut to their first
``--response-chars`` characters (at a word) and prompts never cut, so every mode scores
exactly the same response tokens.

    python bench/bench_c2c_learning.py                       # its time budget: 100 min (--budget-min)
    python bench/bench_c2c_learning.py --quick               # a few minutes: the pipeline only
    python bench/bench_c2c_learning.py --budget-min 600 --max-seen 65536   # a GPU machine

Writes ``bench/results/bench_c2c_learning.json`` after every point, and a PNG beside it.
Prompt caches persist in ``--prefill-dir`` (keyed by model version), so a rerun skips them.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import replace
import math
import sys
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
from edgefuse.c2c.hub import fuser_config, train_device, train_threads, use_amp  # noqa: E402
from edgefuse.c2c.prefill import PrefillStore, Prefiller  # noqa: E402
from edgefuse.c2c.train import evaluate_pair, train_fuser  # noqa: E402
from edgefuse.eval.queries import HINT_HEADER  # noqa: E402
from edgefuse.eval.splits import fuser_training_rows, heldout_rows  # noqa: E402
from edgefuse.eval.stats import bootstrap_mean_interval, paired_difference  # noqa: E402

CONTROLS = {"c2c": "none", "zero": "zero", "shuffled": "shuffled"}


def cut(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters, at the last space before the cut."""
    text = text.strip()
    if len(text) <= chars:
        return text
    head = text[:chars]
    return head[:head.rfind(" ")] if " " in head else head


def est(values) -> dict:
    e = bootstrap_mean_interval(values)
    return {"mean": e.value, "low": e.low, "high": e.high, "n": e.n}


def diff(a, b) -> dict:
    e = paired_difference(a, b)
    return {"mean": e.value, "low": e.low, "high": e.high, "n": e.n,
            "excludes_zero": bool(e.low > 0 or e.high < 0)}


@torch.no_grad()
def sharer_answers(model, tok, examples, max_new_tokens: int) -> list[str]:
    """The sharer's greedy answer to each held-out prompt (its own formatted prompt, the
    ids the fusers read: ``sharer_prompt_ids``)."""
    device = next(model.parameters()).device
    out = []
    for ex in examples:
        ids = torch.tensor([ex.sharer_prompt_ids], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return out


def summary(items: dict[str, list[float]], groups: dict[str, list[int]]) -> dict:
    """Means with intervals per mode, and the paired differences that answer the question."""
    res = {}
    for gname, idx in groups.items():
        pick = {m: [v[i] for i in idx] for m, v in items.items()}
        g = {"n": len(idx), "nll": {m: est(v) for m, v in pick.items()}, "paired": {}}
        pairs = [("c2c", "alone"), ("c2c", "zero"), ("c2c", "shuffled"), ("zero", "alone"),
                 ("shuffled", "alone"), ("t2t", "alone"), ("c2c", "t2t")]
        for a, b in pairs:
            if a in pick and b in pick:
                g["paired"][f"{a}-{b}"] = diff(pick[a], pick[b])
        res[gname] = g
    return res


def target_check(s: dict) -> dict:
    """The issue's target on all held-out items: c2c below alone and both controls by
    >= 0.05 nats, each paired interval excluding zero."""
    p = s["all"]["paired"]
    ok = all(k in p and p[k]["mean"] <= -0.05 and p[k]["high"] < 0 for k in ("c2c-alone", "c2c-zero", "c2c-shuffled"))
    return {"met": ok, "rule": "c2c - alone, c2c - zero, c2c - shuffled each <= -0.05 nats with the 95 % "
                               "paired interval below zero, on all held-out items"}


def run_t2t(args, held, held_rows, r_model, r_tok, s_model, s_tok, probe, amp, items, entry, end) -> None:
    """Text-to-text on the held-out items: the sharer's greedy answer in the receiver's
    context; skipped (and said so) when the sharer's answers would not fit the budget."""
    t0 = time.perf_counter()
    answers = []
    for k, ex in enumerate(held):
        if time.time() > end:
            entry["t2t_skipped"] = f"time budget: {k} of {len(held)} sharer answers generated"
            print(f"[bench] T2T skipped: {entry['t2t_skipped']}", flush=True)
            return
        answers += sharer_answers(s_model, s_tok, [ex], args.t2t_tokens)
    hinted = [{**r, "context": (f"{r['context'].strip()}\n\n" if r.get("context", "").strip() else "")
               + f"{HINT_HEADER}\n{a}"} for r, a in zip(held_rows, answers)]
    t2t = build_pair_examples(hinted, r_tok, s_tok, 1024)
    assert [e.continuation_ids[1:] for e in t2t] == [e.continuation_ids[1:] for e in held]
    items["t2t"] = evaluate_pair(probe, r_model, s_model, t2t, gate="off", amp=amp,
                                 receiver_prefill=Prefiller(r_model))["per_example"]
    entry["t2t_seconds"] = time.perf_counter() - t0
    entry["t2t_example"] = {"prompt": held_rows[0]["instruction"][:200], "sharer_answer": answers[0][:300]}


def run_pair(args, cfg, sharer_name, receiver_name, models, store, report, entry, budget_end, max_seen):
    device = train_device(cfg.c2c.train)
    amp = use_amp(cfg.c2c.train, device)
    r_model, r_tok = models[receiver_name]
    s_model, s_tok = models[sharer_name]
    rows = fuser_training_rows(cfg, int(cfg.seed))
    held_rows = (heldout_rows(cfg, "dolly_eval", args.heldout_dolly, int(cfg.seed))
                 + heldout_rows(cfg, "gsm8k_test", args.heldout_gsm8k, int(cfg.seed)))
    held_rows = [{**r, "response": cut(r["response"], args.response_chars)} for r in held_rows]
    train = build_pair_examples(rows, r_tok, s_tok, args.max_seq_len)
    held = build_pair_examples(held_rows, r_tok, s_tok, 1024)
    assert len(held) == len(held_rows), "a held-out row gave no example"
    groups = {"all": list(range(len(held))),
              "dolly": [i for i, r in enumerate(held_rows) if r["source"] != "gsm8k_test"],
              "gsm8k": [i for i, r in enumerate(held_rows) if r["source"] == "gsm8k_test"]}
    entry.update(train_examples=len(train), heldout=len(held), heldout_dolly=len(groups["dolly"]),
                 heldout_gsm8k=len(groups["gsm8k"]), sources=sorted({r["source"] for r in rows}))
    pre = {"receiver_prefill": Prefiller(r_model, f"{receiver_name}@base", store),
           "sharer_prefill": Prefiller(s_model, f"{sharer_name}@base", store)}
    t0 = time.perf_counter()
    from tqdm.auto import tqdm

    for ex in tqdm(train + held, desc=f"prefill {sharer_name}->{receiver_name}", leave=False):
        pre["receiver_prefill"](ex.receiver_prompt_ids)
        pre["sharer_prefill"](ex.sharer_prompt_ids)
    entry["prefill_seconds"] = time.perf_counter() - t0
    entry["prefill_store"] = {"hits": store.hits, "misses": store.misses}
    print(f"[bench] {sharer_name}->{receiver_name}: {len(train)} training, {len(held)} held-out examples; "
          f"prompt caches in {entry['prefill_seconds']:.0f} s", flush=True)

    fcfg = fuser_config(cfg)
    probe = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config), fcfg)
    items = {"alone": evaluate_pair(probe, r_model, s_model, held, gate="off", amp=amp, **pre)["per_example"]}

    steps_total = max(1, max_seen // args.batch_size)
    seen_points = [p for p in (2 ** k for k in range(4, 30)) if max(args.batch_size, args.first_seen) <= p <= max_seen]
    if seen_points[-1] != steps_total * args.batch_size:
        seen_points.append(steps_total * args.batch_size)
    fusers = {}
    for name, control in CONTROLS.items():
        torch.manual_seed(int(cfg.seed))
        fusers[name] = C2CFuser(kv_spec_from_config(r_model.config), kv_spec_from_config(s_model.config),
                                replace(fcfg, sharer_control=control)).to(device)
    ckpt_root = Path(args.work_dir) / f"{sharer_name}__to__{receiver_name}"
    entry["curve"], entry["schedule"] = [], {"steps": steps_total, "batch_size": args.batch_size,
                                             "lr": args.lr, "max_seen": steps_total * args.batch_size}
    segment_s = None
    for seen in seen_points:
        until = seen // args.batch_size
        if segment_s is not None and time.time() + segment_s * 1.05 > budget_end:
            entry["stopped"] = f"time budget: the next point ({seen} examples) would end past it"
            print(f"[bench] {entry['stopped']}", flush=True)
            break
        t0 = time.perf_counter()
        point = {"examples_seen": seen, "steps": until, "train_loss": {}}
        for name, fuser in fusers.items():
            out = train_fuser(fuser, r_model, s_model, train, steps=steps_total, batch_size=args.batch_size,
                              lr=args.lr, seed=int(cfg.seed), checkpoint_dir=ckpt_root / name,
                              progress=False, micro_batch=args.micro_batch, length_group=16, amp=amp,
                              until=until, keep_last=1, **pre)
            point["train_loss"][name] = out["last_loss"]
            point.setdefault("train_examples_per_s", {})[name] = out["examples_per_s"]
            items[name] = evaluate_pair(fuser, r_model, s_model, held, gate="on", amp=amp,
                                        seed=int(cfg.seed), **pre)["per_example"]
        point["summary"] = summary(items, groups)
        point["target"] = target_check(point["summary"])
        point["seconds"] = time.perf_counter() - t0
        # the next point trains twice as many steps as this segment (log spacing)
        segment_s = point["seconds"] * (2 if seen > seen_points[0] else 1.5)
        entry["curve"].append(point)
        entry["final"] = point["summary"]
        entry["items"] = {m: v for m, v in items.items()}
        report["wall_s"] = time.time() - report["started"]
        atomic_write_json(Path(args.out), report)
        p = point["summary"]["all"]
        print(f"[bench] {sharer_name}->{receiver_name} seen {seen}: NLL alone {p['nll']['alone']['mean']:.4f} "
              f"c2c {p['nll']['c2c']['mean']:.4f} zero {p['nll']['zero']['mean']:.4f} "
              f"shuffled {p['nll']['shuffled']['mean']:.4f}; c2c-zero {p['paired']['c2c-zero']['mean']:+.4f} "
              f"[{p['paired']['c2c-zero']['low']:+.4f}, {p['paired']['c2c-zero']['high']:+.4f}], c2c-shuffled "
              f"{p['paired']['c2c-shuffled']['mean']:+.4f} [{p['paired']['c2c-shuffled']['low']:+.4f}, "
              f"{p['paired']['c2c-shuffled']['high']:+.4f}] ({point['seconds']:.0f} s)", flush=True)
    run_t2t(args, held, held_rows, r_model, r_tok, s_model, s_tok, probe, amp, items, entry,
            budget_end + 60 * args.t2t_grace_min)
    if entry["curve"]:
        last = entry["curve"][-1]
        last["summary"] = summary(items, groups)  # with T2T, on the same items
        entry["final"], entry["items"] = last["summary"], dict(items)
        report["wall_s"] = time.time() - report["started"]
        atomic_write_json(Path(args.out), report)
    del fusers, probe
    gc.collect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="qwen2.5-coder-0.5b->smollm2-135m,gemma3-270m->smollm2-135m",
                    help="sharer->receiver, comma-separated; the first is the strong -> weak pair")
    ap.add_argument("--train-dolly", type=int, default=512)
    ap.add_argument("--train-gsm8k", type=int, default=256)
    ap.add_argument("--heldout-dolly", type=int, default=120)
    ap.add_argument("--heldout-gsm8k", type=int, default=80)
    ap.add_argument("--response-chars", type=int, default=300)
    ap.add_argument("--max-seq-len", type=int, default=128, help="tokens per training example")
    ap.add_argument("--max-seen", type=int, default=2048, help="training examples seen, first pair")
    ap.add_argument("--max-seen-other", type=int, default=1024, help="the same for the other pairs")
    ap.add_argument("--first-seen", type=int, default=64, help="the first point of the curve")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--t2t-tokens", type=int, default=48)
    ap.add_argument("--min-pair-min", type=float, default=15.0,
                    help="a later pair runs only with at least this many minutes of budget left")
    ap.add_argument("--t2t-grace-min", type=float, default=10.0,
                    help="minutes past a pair's budget its T2T baseline may still take")
    ap.add_argument("--budget-min", type=float, default=100.0, help="wall-clock budget of the whole run")
    ap.add_argument("--prefill-dir", default=str(Path.home() / ".cache" / "edgefuse" / "bench-prefill"))
    ap.add_argument("--work-dir", default=str(ROOT / "bench" / "results" / ".c2c_learning"))
    ap.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_c2c_learning.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.train_dolly, args.train_gsm8k, args.heldout_dolly, args.heldout_gsm8k = 24, 8, 8, 8
        args.max_seen = args.max_seen_other = 32
        args.first_seen = 16
        args.t2t_tokens = 8
    pairs = [tuple(p.strip() for p in item.split("->")) for item in args.pairs.split(",")]
    per_cat = max(1, math.ceil(args.heldout_dolly / 8))
    cfg = compose("default", [f"c2c.train.data=[{{source: dolly_public, n: {args.train_dolly}}}, "
                              f"{{source: gsm8k_train, n: {args.train_gsm8k}}}]",
                              f"data.public_slices.eval_per_category={per_cat}", "c2c.eval.dolly_per_category=1"])
    torch.set_num_threads(train_threads(cfg.c2c.train))
    device = train_device(cfg.c2c.train)
    import shutil

    shutil.rmtree(args.work_dir, ignore_errors=True)  # fresh fusers: the curve starts at 0
    report = {"started": time.time(), "args": vars(args), "device": str(device),
              "threads": torch.get_num_threads(), "amp_bf16": use_amp(cfg.c2c.train, device),
              "fuser_config": fuser_config(cfg).to_dict(), "metric": "mean NLL per response token (nats), "
              "per item, items paired across modes; 95 % paired-bootstrap intervals", "pairs": []}
    budget_end = time.time() + 60 * args.budget_min
    store = PrefillStore(args.prefill_dir)
    models: dict[str, tuple] = {}
    for k, (sharer, receiver) in enumerate(pairs):
        for name in (sharer, receiver):
            if name not in models:
                m, tok = load_model(name, root=cfg.paths.cache_dir)
                m.eval()
                m.requires_grad_(False)
                models[name] = (m.to(device), tok)
        for name in [n for n in models if n not in (sharer, receiver)]:
            del models[name]  # free a sharer no longer needed
        gc.collect()
        entry = {"sharer": sharer, "receiver": receiver, "strong_to_weak": k == 0}
        report["pairs"].append(entry)
        if k > 0 and budget_end - time.time() < 60 * args.min_pair_min:
            entry["skipped"] = f"time budget: under {args.min_pair_min:g} min left for this pair"
            print(f"[bench] {sharer}->{receiver} skipped: {entry['skipped']}", flush=True)
            continue
        # the first pair may use the budget the others leave: give each later pair its share
        pair_end = budget_end if k == len(pairs) - 1 else time.time() + (budget_end - time.time()) * (0.75 if k == 0 else 0.5)
        run_pair(args, cfg, sharer, receiver, models, store, report, entry, pair_end,
                 args.max_seen if k == 0 else args.max_seen_other)
        report["wall_s"] = time.time() - report["started"]
        atomic_write_json(Path(args.out), report)
        _plot(report, Path(args.out).with_suffix(".png"))
    first = report["pairs"][0]
    if first.get("curve"):
        report["target"] = first["curve"][-1]["target"]
    atomic_write_json(Path(args.out), report)
    _plot(report, Path(args.out).with_suffix(".png"))
    print(f"[bench] wrote {args.out} ({report['wall_s'] / 60:.0f} min)")
    return 0


def _plot(report: dict, path: Path) -> None:
    import io

    from matplotlib.figure import Figure

    pairs = [p for p in report["pairs"] if p.get("curve")]
    if not pairs:
        return
    fig = Figure(figsize=(6 * len(pairs), 7.5), constrained_layout=True)
    axes = fig.subplots(2, len(pairs), squeeze=False)
    colors = {"c2c": "tab:green", "zero": "tab:orange", "shuffled": "tab:purple"}
    for j, p in enumerate(pairs):
        xs = [pt["examples_seen"] for pt in p["curve"]]
        top, bottom = axes[0][j], axes[1][j]
        for m, c in colors.items():
            ys = [pt["summary"]["all"]["nll"][m]["mean"] for pt in p["curve"]]
            top.plot(xs, ys, "o-", color=c, label=m if m == "c2c" else f"{m} sharer (control)")
        fin = p["final"]["all"]["nll"]
        top.axhline(fin["alone"]["mean"], ls="--", color="grey", label="receiver alone")
        if "t2t" in fin:
            top.axhline(fin["t2t"]["mean"], ls=":", color="tab:blue", label="text-to-text")
        top.set_xscale("log", base=2)
        top.set_ylabel("held-out NLL (nats / response token)")
        top.set_title(f"{p['receiver']} <- {p['sharer']} (n={p['heldout']})")
        top.legend(fontsize=8)
        for key, c in (("c2c-zero", "tab:orange"), ("c2c-shuffled", "tab:purple"), ("c2c-alone", "grey")):
            d = [pt["summary"]["all"]["paired"][key] for pt in p["curve"]]
            bottom.errorbar(xs, [x["mean"] for x in d], yerr=[[x["mean"] - x["low"] for x in d],
                                                              [x["high"] - x["mean"] for x in d]],
                            fmt="o-", color=c, capsize=3, label=key)
        bottom.axhline(0, color="black", lw=0.8)
        bottom.axhline(-0.05, color="red", lw=0.8, ls="--", label="target -0.05")
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("training examples seen")
        bottom.set_ylabel("paired difference (nats), 95 % CI")
        bottom.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
