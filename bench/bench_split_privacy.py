"""Privacy at the split: how much of a prompt the cloud recovers from what split inference sends.

In split inference (:mod:`edgefuse.cloud.split`) the cloud receives the activations after the
device's first ``k`` layers (MID, int8 with per-row scales as sent) and, with a split head,
the tail columns ``[s:]`` of the final hidden state (HEAD). This runs the privacy probe
(:mod:`edgefuse.attacks.probe`, payloads ``split_acts`` / ``split_head``) on the cloud's
target (Qwen2.5-Coder-1.5B by default): canary prompts (PII templates with synthetic
identities) are protected on the device (``none`` / ``redact`` / ``rephrase`` / ``both``;
the device's SLM rephrases, the redactor knows the device's identities), each is run
through the split's own front at every ``k`` and encoded with the activation codec, and a
linear attacker trained on public Dolly prompts (ridge regression to the input embedding,
nearest token) inverts the decoded rows. Scored against the *raw* prompt: token accuracy
(LCS / length, bootstrap 95 % interval) and exact match (Wilson 95 % interval), n = the
canary prompts. Beside each k: the probe's float16 ``hidden`` payload after layer k - 1 (the
same rows without the int8 codec) and the literature's learned attackers (about 59 % of tokens
recovered from a 2-layer split, 35 % from an 8-layer split).

    python bench/bench_split_privacy.py                # qwen2.5-coder-1.5b, k = 1 2 4 8, m = 2, HEAD s = D/2
    python bench/bench_split_privacy.py --quick        # tiny random Llama (k = 1 2), seconds: the pipeline only
    python bench/bench_split_privacy.py --ks 2 8 --modes none redact --train-prompts 120

Writes ``bench/results/bench_split_privacy.json`` and a PNG beside it (``--quick``:
``bench_split_privacy_quick.*``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.results.plotting import new_figure, save_png  # noqa: E402

LITERATURE = {2: 0.59, 8: 0.35}  # token accuracy of learned attackers inverting a k-layer split


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the split target (default: cloud.model of the default config)")
    p.add_argument("--rephraser", default="qwen2.5-coder-0.5b", help="the device SLM that rephrases")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="split points attacked (default 1 2 4 8)")
    p.add_argument("--m", type=int, default=None, help="the device's last layers (default 2, as cloud.split.m)")
    p.add_argument("--act", default="int8", choices=["int8", "float16"])
    p.add_argument("--head-split", type=int, default=None, help="HEAD: the device's head columns s "
                   "(default D/2; 0 = no split head)")
    p.add_argument("--modes", nargs="+", default=["none", "redact", "rephrase", "both"])
    p.add_argument("--canaries", type=int, default=24)
    p.add_argument("--train-prompts", type=int, default=200, help="public prompts the attacker trains on")
    p.add_argument("--rephrase-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mirror", default=None, help="data mirror (default: as every entry point resolves it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="tiny random models, 8 canaries, 48 prompts")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rephraser = "tiny-llama", "tiny-qwen2"
        args.ks, args.m = args.ks or [1, 2], 0 if args.m is None else args.m
        args.canaries, args.train_prompts, args.rephrase_tokens = 8, 48, 24
    args.ks = args.ks or [1, 2, 4, 8]
    args.m = 2 if args.m is None else args.m
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / f"bench_split_privacy{'_quick' if args.quick else ''}.json")
    return args


def split_table(layers: list[dict]) -> list[dict]:
    """One row per (payload, k, protection) of the split payloads, with the float16 ``hidden``
    attack after layer ``k - 1`` beside ``split_acts`` and the literature figure where known."""
    hidden = {(x["layer"], x["protection"]): x for x in layers if x["payload"] == "hidden"}
    out = []
    for x in layers:
        if x["payload"] not in ("split_acts", "split_head"):
            continue
        r = {key: x[key] for key in x if key != "layer"}
        if x["payload"] == "split_acts":
            h = hidden.get((x["k"] - 1, x["protection"]))
            r["hidden_float16_token_acc"] = None if h is None else h["attacker_token_acc"]
            r["literature_token_acc"] = LITERATURE.get(x["k"])
        out.append(r)
    return out


def plot(table: list[dict], result: dict, path: Path) -> Path:
    """Token accuracy and exact match per k (95 % intervals), one line per protection; HEAD
    as points at the right, the literature's learned attackers as black crosses."""
    fig = new_figure(figsize=(11, 3.8))
    modes = list(dict.fromkeys(r["protection"] for r in table))
    ks = sorted({r["k"] for r in table if r["payload"] == "split_acts"})
    head_x = max(ks) * 2 if ks else 1
    for j, (key, label) in enumerate((("attacker_token_acc", "attacker token accuracy"),
                                      ("attacker_exact_match", "exact match of the whole prompt"))):
        ax = fig.add_subplot(1, 2, j + 1)
        for mode in modes:
            pts = sorted((r["k"], r[key], r[f"{key}_ci95_low"], r[f"{key}_ci95_high"]) for r in table
                         if r["payload"] == "split_acts" and r["protection"] == mode)
            line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                               yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                               marker="o", capsize=3, label=mode)
            for r in table:
                if r["payload"] == "split_head" and r["protection"] == mode:
                    ax.errorbar([head_x], [r[key]], yerr=[[r[key] - r[f"{key}_ci95_low"]],
                                                          [r[f"{key}_ci95_high"] - r[key]]],
                                marker="s", capsize=3, color=line[0].get_color())
        if key == "attacker_token_acc":
            lit = sorted((k, v) for k, v in LITERATURE.items() if k in ks)
            if lit:
                ax.plot([k for k, _ in lit], [v for _, v in lit], "kx", markersize=9, label="literature (learned)")
        ax.set_xscale("log", base=2)
        ticks = ks + ([head_x] if any(r["payload"] == "split_head" for r in table) else [])
        ax.set_xticks(ticks, [str(k) for k in ks] + (["HEAD"] if len(ticks) > len(ks) else []))
        ax.set_xlabel("split point k (device layers before the cloud)")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.legend(fontsize="small")
    fig.suptitle(f"{result['model']}: what the cloud recovers from {result['act']} split activations "
                 f"(m = {result['m']}, n = {result['canaries']} canary prompts, linear attacker on "
                 f"{result['train_prompts']} public prompts)", fontsize=9)
    return save_png(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args, argv)
    except (ValueError, FileNotFoundError) as e:  # a split the target cannot take, no mirror
        print(f"bench_split_privacy: {e}", file=sys.stderr)
        return 2


def run(args, argv) -> int:
    import torch
    from omegaconf import OmegaConf

    from edgefuse.attacks.probe import default_protector, run_probe
    from edgefuse.config import compose, resolve_paths
    from edgefuse.models import load_model, model_config
    from edgefuse.privacy.canaries import load_canary_prompts
    from edgefuse.privacy.redact import Redactor

    torch.set_num_threads(args.threads)
    mirror = args.mirror or (None if resolve_paths().data_mirror is None else str(resolve_paths().data_mirror))
    cfg = compose("default", ([f"data.mirror={mirror}"] if mirror else [])
                  + [f"privacy.probe.attack_train_prompts={args.train_prompts}"])
    model_name = args.model or str(cfg.cloud.model)
    D = int(model_config(model_name).hidden_size)
    s = (D // 2 if args.head_split is None else args.head_split) or None
    split = {"ks": list(args.ks), "m": args.m, "act": args.act, "head_split": s}
    priv = OmegaConf.merge(cfg.privacy, {"probe": {
        "canaries": args.canaries, "task_n": 0, "attack_train_prompts": args.train_prompts,
        "attack_layers": sorted({k - 1 for k in args.ks}), "modes": list(args.modes), "split": split}})
    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    model.eval()
    slm, slm_tok = load_model(args.rephraser)
    slm.eval()
    # the device protects with its own SLM and a redactor that knows its identities
    red = priv.redact
    redactor = Redactor(entities=list(red.entities), score_threshold=float(red.score_threshold),
                        spacy_model=str(red.spacy_model))
    redactor.remember(sorted({c for p in load_canary_prompts(mirror, args.canaries, args.seed) for c in p.canaries}))
    protector = default_protector(slm, slm_tok, redactor, args.rephrase_tokens, int(priv.rephrase.attempts))

    def progress(stage, done, total):
        if done == total or done % 25 == 0:
            print(f"[{time.perf_counter() - t0:7.1f} s] {stage}: {done}/{total}", flush=True)

    res = run_probe(model, tok, priv, mirror, cfg.data, args.seed, protector=protector, progress=progress)
    result = {
        "command": "python bench/bench_split_privacy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": model_name, "rephraser": args.rephraser, "hidden_size": D, "n_layers":
        int(model.config.num_hidden_layers), "ks": list(args.ks), "m": args.m, "act": args.act,
        "head_split": s, "canaries": args.canaries, "train_prompts": args.train_prompts,
        "modes": list(args.modes), "threads": args.threads, "seed": args.seed,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "literature_token_acc": {str(k): v for k, v in LITERATURE.items()},
        "scoring": "token accuracy = LCS(recovered, raw prompt) / its length (bootstrap 95 % interval); "
                   "exact match = the recovered text is the raw prompt (Wilson 95 % interval); n = canary prompts",
        "rephrase_fallbacks": res.rephrase_fallbacks, "seconds": res.seconds,
    }
    table = split_table(res.layers)
    result["split"] = table
    result["rows"] = res.rows
    out = Path(args.out)
    atomic_write_json(out, result)
    plot(table, result, out.with_suffix(".png"))
    f = (lambda v: "   -" if v is None else f"{v:.3f}")
    print(f"{'payload':11} {'k':>2} {'protection':10} {'tok acc':>7} {'95% CI':>13} {'exact':>6} "
          f"{'hidden f16':>10} {'literature':>10}")
    for r in table:
        print(f"{r['payload']:11} {r['k']:2d} {r['protection']:10} {r['attacker_token_acc']:7.3f} "
              f"[{r['attacker_token_acc_ci95_low']:.3f}, {r['attacker_token_acc_ci95_high']:.3f}] "
              f"{r['attacker_exact_match']:6.3f} {f(r.get('hidden_float16_token_acc')):>10} "
              f"{f(r.get('literature_token_acc')):>10}")
    hits = {(r["payload"], r["protection"]): r["canary_hits"] for r in res.rows if r["payload"].startswith("split")}
    print(f"canary hits in split payloads: {hits}; rephrase fallbacks {res.rephrase_fallbacks}")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
