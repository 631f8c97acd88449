"""Benchmark the privacy of every outbound payload type under each protection.

Runs the privacy probe (:mod:`edgefuse.attacks.probe`) on a real device model: canary prompts
(PII templates filled with synthetic identities from the data mirror) are protected on the
device (``none`` / ``redact`` / ``rephrase`` / ``both``), every payload type is built with
the real encoders and scanned for canaries, and linear inversion attackers trained on public
Dolly prompts try to recover the raw prompt from each payload, layer by layer. The task cost
of each protection is MMLU accuracy (log-likelihood of the choice letters) with the question
stem protected.

    python bench/bench_privacy.py                       # qwen2.5-coder-0.5b, ~25 min here
    python bench/bench_privacy.py --quick               # 8 canaries, 8 MMLU, 3 layers
    python bench/bench_privacy.py --model smollm2-135m

Writes ``bench/results/bench_privacy.json`` and two PNGs beside it: the payload × protection
table (attacker token accuracy, canary hits, task accuracy) and attacker accuracy per layer.
Targets (issue 5): 0 canary hits with redaction on; attacker token accuracy on shared KV
caches of rephrased prompts at least 2x lower than on raw prompts; a task-accuracy cost of at
most 3 points.
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

from edgefuse.io import atomic_write_json
from edgefuse.results.plotting import new_figure as _new_figure, save_png as _save_png  # noqa: E402
from edgefuse.results.privacy import plot_privacy  # noqa: E402


def default_mirror() -> str | None:
    """The data mirror as every entry point resolves it (edgefuse.config.resolve_paths)."""
    from edgefuse.config import resolve_paths

    mirror = resolve_paths().data_mirror
    return None if mirror is None else str(mirror)


def check_targets(rows: list[dict], task_cost_points: float = 3.0) -> dict:
    """The issue's targets, each ``{"value", "target", "met"}``."""
    def cell(payload, prot, key):
        for r in rows:
            if r["payload"] == payload and r["protection"] == prot:
                return r.get(key)
        return None

    out = {}
    hits = sum(r["canary_hits"] for r in rows if r["protection"] in ("redact", "both"))
    out["canary_hits_with_redaction"] = {"value": hits, "target": 0, "met": hits == 0}
    raw = cell("kv", "none", "attacker_token_acc")
    task0 = cell("kv", "none", "task_acc")
    for prot in ("rephrase", "both", "redact"):
        acc = cell("kv", prot, "attacker_token_acc")
        if raw is not None and acc is not None:
            ratio = raw / acc if acc > 0 else float("inf")
            out[f"kv_attack_reduction_{prot}"] = {"value": ratio, "target": 2.0, "met": ratio >= 2.0,
                                                 "raw": raw, "protected": acc}
        task = cell("kv", prot, "task_acc")
        if task0 is not None and task is not None:
            cost = 100.0 * (task0 - task)
            out[f"task_cost_points_{prot}"] = {"value": cost, "target": task_cost_points,
                                               "met": cost <= task_cost_points}
    return out


def plot_layers(layers: list[dict], path: Path) -> Path:
    fig = _new_figure(figsize=(11, 3.4))
    payloads = [p for p in ("kv", "hidden") if any(r["payload"] == p for r in layers)]
    for j, payload in enumerate(payloads):
        ax = fig.add_subplot(1, len(payloads), j + 1)
        for prot in dict.fromkeys(r["protection"] for r in layers):
            pts = sorted((r["layer"], r["attacker_token_acc"]) for r in layers
                         if r["payload"] == payload and r["protection"] == prot)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prot)
        ax.set_xlabel("layer")
        ax.set_ylabel("attacker token accuracy")
        ax.set_ylim(0, 1)
        ax.set_title(f"{payload}: which layers leak most", fontsize=9)
        ax.legend(fontsize="small")
    return _save_png(fig, path)


def rescan(model, tok, priv, args, out: Path) -> int:
    """Recount the canary hits per payload × protection with the current audit (the same
    canary prompts, protections and encoders as the probe) and update ``out`` in place."""
    import json

    from edgefuse.privacy.audit import OutboundAudit
    from edgefuse.privacy.canaries import load_canary_prompts
    from edgefuse.attacks.probe import _observe, default_protector, resolve_layers
    from edgefuse.privacy.redact import Redactor

    report = json.loads(out.read_text())
    prompts = load_canary_prompts(args.mirror, int(priv.probe.canaries), args.seed)
    values = sorted({c for p in prompts for c in p.canaries})
    red = Redactor(entities=list(priv.redact.entities))
    red.remember(values)
    protector = default_protector(model, tok, red, int(priv.rephrase.max_new_tokens))
    audit = OutboundAudit()
    audit.watch(values)
    audit.use_tokenizer(tok)
    layers = resolve_layers(list(priv.probe.attack_layers), int(model.config.num_hidden_layers))
    hits = {}
    for mode in priv.probe.modes:
        texts, _ = protector([p.text for p in prompts], str(mode))
        audit.snapshot(reset=True)
        for text in texts:
            _, payloads, _ = _observe(model, tok, text, layers, int(priv.probe.topk), 64)
            audit.outbound("prompt_text", text.encode("utf-8"))
            for kind, data in payloads.items():
                audit.outbound(kind, data)
        stats = audit.snapshot(reset=True)
        for payload, st in stats.items():
            hits[(payload, str(mode))] = st["canary_hits"]
        print(f"{mode}: " + ", ".join(f"{k} {v['canary_hits']}" for k, v in stats.items()), flush=True)
    for row in report["rows"]:
        if row["payload"] == "adapter":
            continue
        extra = hits.get(("prompt_text", row["protection"]), 0) if row["payload"] == "draft_tokens" else 0
        row["canary_hits"] = hits.get((row["payload"], row["protection"]), 0) + extra
    report["targets"] = check_targets(report["rows"])
    report["canary_rescan"] = "python bench/bench_privacy.py --rescan-canaries"
    atomic_write_json(out, report)
    plot_privacy({"privacy": report["rows"]}, out.with_suffix(".png"))
    print(f"updated the canary hits in {out}: {report['targets']['canary_hits_with_redaction']}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="the device model attacked")
    ap.add_argument("--quick", action="store_true", help="8 canaries, 8 MMLU questions, 3 layers")
    ap.add_argument("--canaries", type=int, default=24)
    ap.add_argument("--train-prompts", type=int, default=300, help="public prompts the attacker trains on")
    ap.add_argument("--task-n", type=int, default=40, help="MMLU questions per protection")
    ap.add_argument("--layers", default="0,0.125,0.25,0.375,0.5,0.625,0.75,0.875,1.0",
                    help="attacked layers: indices or fractions of depth")
    ap.add_argument("--rephrase-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mirror", default=default_mirror())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_privacy.json"))
    ap.add_argument("--rescan-canaries", action="store_true",
                    help="recount only the canary hits of every payload (no attackers, no task) and "
                         "update them in an existing --out JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.canaries, args.task_n, args.train_prompts, args.layers = 8, 8, 100, "0,0.5,1.0"
    import torch
    from omegaconf import OmegaConf

    from edgefuse.config import compose
    from edgefuse.models import load_model
    from edgefuse.attacks.probe import run_probe

    torch.set_num_threads(args.threads)
    layers = [float(x) if "." in x else int(x) for x in args.layers.split(",") if x]
    # the attacker's prompts are the public split's attack_train slice, sized by this setting
    cfg = compose("default", ([f"data.mirror={args.mirror}"] if args.mirror else [])
                  + [f"privacy.probe.attack_train_prompts={args.train_prompts}"])
    priv = OmegaConf.merge(cfg.privacy, {"rephrase": {"max_new_tokens": args.rephrase_tokens},
                                         "probe": {"canaries": args.canaries, "task_n": args.task_n,
                                                   "attack_train_prompts": args.train_prompts,
                                                   "attack_layers": layers,
                                                   "modes": ["none", "redact", "rephrase", "both"]}})
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    model.eval()

    def progress(stage, done, total):
        if done == total or done % 25 == 0:
            print(f"[{time.perf_counter() - t0:7.1f} s] {stage}: {done}/{total}", flush=True)

    if args.rescan_canaries:
        return rescan(model, tok, priv, args, Path(args.out))
    res = run_probe(model, tok, priv, args.mirror, cfg.data, args.seed, progress=progress)
    targets = check_targets(res.rows)
    out = Path(args.out)
    report = {
        "command": "python bench/bench_privacy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "canaries": args.canaries, "train_prompts": args.train_prompts,
        "task_n": args.task_n, "layers": layers, "threads": args.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "seconds": res.seconds, "ner_recall": res.ner_recall,
        "rephrase_fallbacks": res.rephrase_fallbacks, "targets": targets,
        "rows": res.rows, "layers_detail": res.layers,
    }
    atomic_write_json(out, report)
    plot_privacy({"privacy": res.rows}, out.with_suffix(".png"))
    plot_layers(res.layers, out.with_name(out.stem + "_layers.png"))
    print(f"{'payload':13} {'protection':10} {'hits':>5} {'tok acc':>8} {'exact':>6} {'layer':>5} {'task':>6}")
    for r in res.rows:
        f = (lambda v, s: "-" if v is None else format(v, s))
        print(f"{r['payload']:13} {r['protection']:10} {r['canary_hits']:5d} {f(r['attacker_token_acc'], '.3f'):>8} "
              f"{f(r['attacker_exact_match'], '.2f'):>6} {f(r['layer'], 'd'):>5} {f(r['task_acc'], '.3f'):>6}")
    for k, v in targets.items():
        print(f"target {k}: {v['value']:.3f} (target {v['target']}) {'met' if v['met'] else 'MISSED'}")
    print(f"NER-only recall of canary values {res.ner_recall:.3f}; rephrase fallbacks {res.rephrase_fallbacks}")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
