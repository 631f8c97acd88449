"""Device runtimes side by side: PyTorch float32 against ONNX Runtime (fp32 / int8 / int4).

Per edge SLM and runtime (each cell in a fresh process, so its peak RSS is its own):

- decoding speed over the runtime interface (``EdgeLM`` / ``OnnxEdgeLM``): time to first token
  (the prompt's prefill) and tokens/s of ``--new-tokens`` greedy steps, at 1 and 2 threads;
- agreement with PyTorch float32: greedy outputs identical (per prompt, Wilson 95 %) and
  next-token agreement teacher-forced on PyTorch's own continuation (per-prompt means,
  bootstrap 95 % over prompts);
- held-out perplexity (the Dolly response given its prompt) and its ratio to PyTorch's,
  paired over the same items (bootstrap 95 %);
- export time (``edgefuse models export``, rebuilt in this run) and peak RSS;
- fp32 parity: the largest |logit difference| from PyTorch over every prompt position;
- memory per profile and phase (separate processes): LoRA training of the model
  (``training.*`` defaults, 10 steps) and decoding (2 prompts), with the RSS after imports.

Then ``spec_async`` at 80 ms RTT against cloud-only (the 1.5B target on the service, one thread
each) with the PyTorch draft (pruned head, today's default, and full head) and the ONNX int8
draft, paired per prompt.

    python bench/bench_edge.py                 # the three SLMs, all runtimes, then spec; ~40 min
    python bench/bench_edge.py --parts spec    # only the speculative rows
    python bench/bench_edge.py --quick         # tiny models, no service: the pipeline, seconds

Writes ``bench/results/bench_edge.json`` after every cell (``--resume`` keeps the cells done)
and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EDGE_SLMS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
TINY = ["tiny-llama", "tiny-gemma3", "tiny-qwen2"]
RUNTIMES = [("torch", "fp32"), ("onnx", "fp32"), ("onnx", "int8"), ("onnx", "int4")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, help=f"default: {' '.join(EDGE_SLMS)}")
    p.add_argument("--quants", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    p.add_argument("--prompts", type=int, default=8, help="held-out Dolly prompts (one per category)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--parts", nargs="+", default=["runtime", "parity", "memory", "spec"],
                   choices=["runtime", "parity", "memory", "spec"])
    p.add_argument("--spec-prompts", type=int, default=8)
    p.add_argument("--rtt", type=float, default=80.0)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    p.add_argument("--quick", action="store_true", help="tiny models, 2 prompts, 8 tokens, no spec")
    p.add_argument("--out", default=None)
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # internal: one cell, as JSON
    args = p.parse_args(argv)
    if args.quick:
        args.models = args.models or TINY
        args.prompts, args.new_tokens, args.threads = 2, 8, [1]
        args.parts = [p for p in args.parts if p != "spec"]
    args.models = args.models or EDGE_SLMS
    name = "bench_edge_quick.json" if args.quick else "bench_edge.json"
    args.out = Path(args.out or ROOT / "bench" / "results" / name)
    return args


def peak_rss_mb() -> float:
    """This process's peak resident set size (MB): ``VmHWM`` on Linux, which starts afresh at
    exec (``ru_maxrss`` can carry the parent's peak into a child), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- cells


def _queries(n: int):
    from edgefuse.config import compose, resolve_paths
    from edgefuse.eval.queries import dolly_eval_queries

    cfg = compose("default")
    resolve_paths(cfg)
    return cfg, dolly_eval_queries(cfg.data, int(cfg.seed), 1)[:n]


def _lm(cell: dict, threads: int):
    """The runtime under test for one thread count: ``(lm, export or None)``."""
    import torch

    from edgefuse.cloud.decoding import EdgeLM, OnnxEdgeLM
    from edgefuse.models import load_model, load_tokenizer

    torch.set_num_threads(threads)
    if cell["runtime"] == "torch":
        model, tok = _lm.cache.get("torch") or load_model(cell["model"])
        _lm.cache["torch"] = (model, tok)
        return EdgeLM(model, tok)
    from edgefuse.runtime import OnnxDecoder

    tok = load_tokenizer(cell["model"])
    return OnnxEdgeLM(OnnxDecoder(cell["folder"], threads=threads), tok)


_lm.cache = {}


def cell_decode(cell: dict) -> dict:
    """Speed, agreement inputs and NLL of one (model, runtime, quant)."""
    import numpy as np
    import torch

    from edgefuse.cloud.devices import prompt_ids
    from edgefuse.models import load_tokenizer

    out = {"export_s": None}
    if cell["runtime"] == "onnx":
        from edgefuse.export import export_onnx

        ex = export_onnx(cell["model"], cell["quant"], force=cell.get("fresh", True), threads=2)
        cell["folder"] = str(ex.folder)
        out["export_s"] = ex.export_s
        out["export_mb"] = sum(p.stat().st_size for p in ex.folder.iterdir()) / 2**20
    _, queries = _queries(cell["prompts"])
    tok = load_tokenizer(cell["model"])
    prompts = [prompt_ids(q, tok, 256) for q in queries]
    n = cell["new_tokens"]
    speed = {}
    greedy = []
    for t in cell["threads"]:
        lm = _lm(cell, t)
        rows = []
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            lm.start(p)
            first = int(lm.logits().argmax())
            ttft = time.perf_counter() - t0
            lm.push(first)
            t1 = time.perf_counter()
            for _ in range(n - 1):
                lm.push(int(lm.logits().argmax()))
            dt = time.perf_counter() - t1
            rows.append({"ttft_s": ttft, "tokens_per_s": (n - 1) / dt})
            if t == cell["threads"][0]:
                greedy.append(lm.tokens[len(p):])
        speed[str(t)] = rows
    out["speed"] = speed
    out["greedy"] = greedy
    # teacher-forced next tokens over the reference continuation, and held-out NLL
    lm = _lm(cell, cell["threads"][-1])
    refs = cell.get("reference") or greedy
    forced = []
    for p, ref in zip(prompts, refs):
        forced.append(_argmax_rows(lm, p + ref[:-1], len(ref)))
    out["forced"] = forced
    nll = []
    for q, p in zip(queries, prompts):
        resp = tok(q.reference or "", add_special_tokens=False)["input_ids"][:128]
        if len(resp) < 2:
            continue
        logits = _logits_rows(lm, p + resp[:-1], len(resp))
        lp = torch.log_softmax(torch.as_tensor(np.asarray(logits), dtype=torch.float32), -1)
        nll.append(float(-lp[torch.arange(len(resp)), torch.tensor(resp)].mean()))
    out["nll"] = nll
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def prompt_ids_for(model: str, n: int) -> list[list[int]]:
    """The chat-templated ids of the first ``n`` held-out prompts for ``model``'s tokenizer."""
    from edgefuse.cloud.devices import prompt_ids
    from edgefuse.models import load_tokenizer

    tok = load_tokenizer(model)
    return [prompt_ids(q, tok, 256) for q in _queries(n)[1]]


def _logits_rows(lm, ids: list[int], last: int):
    """Logits ``[last, V]`` at the last ``last`` positions of one forward over ``ids``."""
    import torch

    if hasattr(lm, "decoder"):
        logits, _ = lm.decoder.forward(ids, lm.decoder.empty())
        return logits[-last:]
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -last:].float().numpy()


def _argmax_rows(lm, ids, last):
    return [int(x) for x in _logits_rows(lm, ids, last).argmax(-1)]


def cell_memory(cell: dict) -> dict:
    """Peak RSS (MB) of one phase on one profile, in a process that does only that, after each
    step: ``imports`` (what a device process imports), ``tokenizer``, ``model`` (weights or
    ONNX Runtime session), then the phase. ``lean``: ONNX Runtime, numpy and the tokenizers
    library only (no PyTorch, no transformers): what the runtime itself needs."""
    steps = {"python": peak_rss_mb()}
    n = cell["new_tokens"]
    if cell.get("lean"):
        import numpy as np
        import tokenizers

        from edgefuse.runtime import OnnxDecoder  # numpy and onnxruntime only

        steps["imports"] = peak_rss_mb()
        if cell["tokenizer"]:  # a tiny model's tokenizer is built in memory, not a file
            tokenizers.Tokenizer.from_file(cell["tokenizer"])
        steps["tokenizer"] = peak_rss_mb()
        dec = OnnxDecoder(cell["folder"])
        steps["model"] = peak_rss_mb()
        for ids in cell["prompt_ids"]:
            logits, past = dec.forward(ids, dec.empty())
            for _ in range(n):
                logits, past = dec.forward([int(np.argmax(logits[-1]))], past)
        steps["decode"] = peak_rss_mb()
        return {"peak_rss_mb": peak_rss_mb(), "steps": steps}
    import torch

    from edgefuse.cloud.decoding import EdgeLM, OnnxEdgeLM
    from edgefuse.models import load_model, load_tokenizer

    steps["imports"] = peak_rss_mb()
    if cell["phase"] == "train":
        from edgefuse import data as data_mod
        from edgefuse.config import compose, lora_targets, resolve_paths
        from edgefuse.lora import attach_lora
        from edgefuse.training import train_steps

        cfg = compose("default")
        resolve_paths(cfg)
        t = cfg.training
        torch.set_num_threads(2)
        model, tok = load_model(cell["model"])
        steps["model"] = peak_rss_mb()
        peft = attach_lora(model, rank=8, alpha=float(t.lora_alpha), dropout=float(t.lora_dropout),
                           target_modules=lora_targets(cfg, cell["model"]), seed=0)
        train_ds, _ = data_mod.client_split(cfg.data, 0, 4, int(cfg.seed))
        rows = data_mod.tokenize_dataset(train_ds, tok, int(cfg.data.max_seq_len))
        steps["data"] = peak_rss_mb()
        t0 = time.perf_counter()
        train_steps(peft, rows, tok.pad_token_id, steps=10, batch_size=int(t.batch_size), lr=float(t.lr),
                    gradient_checkpointing=bool(cell.get("checkpointing")))
        steps["train"] = peak_rss_mb()
        return {"peak_rss_mb": peak_rss_mb(), "steps": steps, "seconds": time.perf_counter() - t0}
    tok = load_tokenizer(cell["model"])
    steps["tokenizer"] = peak_rss_mb()
    if cell["runtime"] == "torch":
        model, _ = load_model(cell["model"])
        lm = EdgeLM(model, tok)
    else:
        from edgefuse.export import export_folder, export_key
        from edgefuse.runtime import OnnxDecoder

        folder = export_folder(cell["model"], cell["quant"], export_key(cell["model"])[1])
        lm = OnnxEdgeLM(OnnxDecoder(folder), tok)
    steps["model"] = peak_rss_mb()
    for ids in cell["prompt_ids"]:
        lm.start(ids)
        for _ in range(n):
            lm.push(int(lm.logits().argmax()))
    steps["decode"] = peak_rss_mb()
    return {"peak_rss_mb": peak_rss_mb(), "steps": steps}


def cell_spec(cell: dict) -> dict:
    """cloud vs spec_async at one RTT with the PyTorch and ONNX int8 drafts (one service)."""
    import torch

    from edgefuse.app.device import DeviceHome, keys_root
    from edgefuse.cloud.decoding import DecodeConfig, DrafterSpec
    from edgefuse.cloud.devices import pruned_head, run_devices, summarize
    from edgefuse.cloud.service import start_service_process, stop_service_process
    from edgefuse.cloud.target import tokenizer_fingerprint
    from edgefuse.export import export_onnx
    from edgefuse.models import load_model
    from edgefuse.runtime import OnnxDecoder
    from edgefuse.transport.identity import provision
    from edgefuse.transport.wan import WanProfile

    torch.set_num_threads(1)
    cfg, queries = _queries(cell["prompts"])
    provision(keys_root(), 1)
    home = DeviceHome.of({"partition-id": 0})
    keys = {"identity": home.identity(), "trust": home.trust()}
    model, tok = load_model(cell["draft"])
    onnx = OnnxDecoder(export_onnx(cell["draft"], "int8").folder, threads=1)
    head = pruned_head(model, tok, cfg.data, int(cfg.seed), 32768)
    fp = tokenizer_fingerprint(tok)
    dcfg = DecodeConfig(max_new_tokens=cell["new_tokens"], timeout_s=600)
    wan = WanProfile(rtt_ms=cell["rtt"], bandwidth_mbps=20.0)
    log_path = Path(cell["out"]).with_name("bench_edge_service.log")
    proc, port = start_service_process(cell["target"], threads=1, log_path=log_path, timeout_s=900)
    rows, records = [], []
    try:
        runs = [("cloud", "torch", DrafterSpec("full_head"), None, None),
                ("spec_async", "torch_pruned_head", DrafterSpec("pruned_head"), head, None),
                ("spec_async", "torch_full_head", DrafterSpec("full_head"), None, None),
                ("spec_async", "onnx_int8", DrafterSpec("full_head"), None, onnx)]
        for mode, label, spec, h, runtime in runs:
            recs, wall = run_devices(model, tok, queries, [mode], dcfg, "127.0.0.1", port, wan, 1, fp,
                                     head=h, drafter=spec, runtime=runtime, **keys)
            got = summarize(recs, wall, tok, cell["rtt"], 1, greedy=True)[0]
            got["draft_runtime"] = label
            rows.append(got)
            records += [{**r.to_dict(), "draft_runtime": label} for r in recs]
            print(f"  {label:<18} {mode:<10} {got['tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    finally:
        stop_service_process(proc)
    return {"rows": rows, "records": records, "peak_rss_mb": peak_rss_mb()}


def cell_parity(cell: dict) -> dict:
    """fp32 parity: the largest |logit difference| between the fp32 ONNX export and PyTorch over
    every position of ``prompts`` held-out prompts (one forward each), and the logits' scale."""
    import numpy as np
    import torch

    from edgefuse.cloud.devices import prompt_ids
    from edgefuse.export import export_onnx
    from edgefuse.models import load_model
    from edgefuse.runtime import OnnxDecoder

    model, tok = load_model(cell["model"])
    dec = OnnxDecoder(export_onnx(cell["model"], "fp32").folder)
    diffs, scale, positions = [], 0.0, 0
    for q in _queries(cell["prompts"])[1]:
        ids = prompt_ids(q, tok, 256)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        got, _ = dec.forward(ids, dec.empty())
        diffs.append(float(np.abs(got - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
        positions += len(ids)
    return {"max_abs_logit_diff": max(diffs), "per_prompt": diffs, "max_abs_logit": scale,
            "positions": positions}


CELLS = {"decode": cell_decode, "memory": cell_memory, "spec": cell_spec, "parity": cell_parity}


def run_cell(cell: dict) -> dict:
    """Run one cell in a fresh Python process; its JSON result (or its error, one line)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--cell", json.dumps(cell)], capture_output=True,
                          text=True, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": err[:300], "wall_s": time.perf_counter() - t0}
    res = json.loads(lines[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- summary


def summarize_model(cells: dict, model: str, threads: list[int]) -> list[dict]:
    """One row per runtime of ``model``: speed, agreement with PyTorch, perplexity ratio."""
    from edgefuse.eval import stats

    ref = cells.get(f"decode/{model}/torch/fp32")
    rows = []
    for runtime, quant in RUNTIMES:
        c = cells.get(f"decode/{model}/{runtime}/{quant}")
        if not c or "error" in c:
            if c:
                rows.append({"model": model, "runtime": runtime, "quant": quant, "error": c["error"]})
            continue
        row = {"model": model, "runtime": runtime, "quant": quant, "export_s": c.get("export_s"),
               "export_mb": c.get("export_mb"), "peak_rss_mb": c["peak_rss_mb"], "prompts": len(c["greedy"])}
        for t in threads:
            sp = c["speed"].get(str(t), [])
            if sp:
                row[f"tokens_per_s_{t}t"] = sum(r["tokens_per_s"] for r in sp) / len(sp)
                row[f"ttft_s_{t}t"] = sum(r["ttft_s"] for r in sp) / len(sp)
                rsp = ref["speed"].get(str(t), []) if ref and "error" not in ref else []
                if rsp and runtime != "torch":
                    est = stats.bootstrap_mean_interval([math.log(a["tokens_per_s"] / b["tokens_per_s"])
                                                         for a, b in zip(sp, rsp)])
                    row[f"speedup_{t}t"] = math.exp(est.value)
                    row[f"speedup_{t}t_ci95"] = [math.exp(est.low), math.exp(est.high)]
        if ref and "error" not in ref and runtime != "torch":
            same = stats.proportion([a == b for a, b in zip(c["greedy"], ref["greedy"])])
            row["greedy_identical"], row["greedy_identical_ci95"] = same.value, [same.low, same.high]
            per = [sum(x == y for x, y in zip(f, g)) / max(len(g), 1) for f, g in zip(c["forced"], ref["greedy"])]
            agree = stats.bootstrap_mean_interval(per)
            row["next_token_agreement"] = agree.value
            row["next_token_agreement_ci95"] = [agree.low, agree.high]
            row["next_token_positions"] = sum(len(g) for g in ref["greedy"])
            d = stats.bootstrap_mean_interval([a - b for a, b in zip(c["nll"], ref["nll"])])
            row["perplexity"] = math.exp(sum(c["nll"]) / len(c["nll"]))
            row["perplexity_ratio"] = math.exp(d.value)
            row["perplexity_ratio_ci95"] = [math.exp(d.low), math.exp(d.high)]
            row["perplexity_items"] = len(c["nll"])
        elif runtime == "torch":
            row["perplexity"] = math.exp(sum(c["nll"]) / len(c["nll"])) if c["nll"] else None
        rows.append(row)
    return rows


def spec_summary(spec: dict) -> dict:
    """spec_async / cloud per draft runtime, paired per prompt (geometric mean, bootstrap 95 %),
    and how many outputs equal cloud-only's token for token (greedy: all should)."""
    from edgefuse.eval import stats

    by, toks = {}, {}
    for r in spec.get("records", []):
        label = r["draft_runtime"] if r["mode"] != "cloud" else "cloud"
        by.setdefault(label, {})[r["qid"]] = r["tokens_per_s"]
        toks.setdefault(label, {})[r["qid"]] = r["tokens"]
    cloud = by.get("cloud", {})
    out = {}
    for label, tps in by.items():
        if label == "cloud":
            continue
        common = [q for q in tps if q in cloud and cloud[q] > 0 and tps[q] > 0]
        if not common:
            continue
        est = stats.bootstrap_mean_interval([math.log(tps[q] / cloud[q]) for q in common])
        out[label] = {"speedup": math.exp(est.value), "ci95": [math.exp(est.low), math.exp(est.high)],
                      "n": len(common),
                      "identical_to_cloud": sum(toks[label][q] == toks["cloud"][q] for q in common)}
    return out


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["runtime"] if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    models = list(dict.fromkeys(r["model"] for r in rows))
    labels = [f"{rt} {q}" for rt, q in RUNTIMES]
    w = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        vals = [next((r.get("tokens_per_s_1t", 0) for r in rows if r["model"] == m and
                      f"{r['runtime']} {r['quant']}" == lab), 0) for m in models]
        axes[0].bar([i + j * w for i in range(len(models))], vals, w, label=lab)
    axes[0].set_xticks([i + 0.4 - w / 2 for i in range(len(models))], models, fontsize=8)
    axes[0].set_ylabel("tokens/s, 1 thread")
    axes[0].set_title("decoding speed")
    axes[0].legend(fontsize=7)
    mem = result.get("memory", {})
    names = [k for k in mem if "error" not in mem[k]]
    axes[1].barh(names, [mem[k]["peak_rss_mb"] for k in names])
    axes[1].set_xlabel("peak RSS (MB)")
    axes[1].set_title("memory per profile and phase")
    axes[1].tick_params(axis="y", labelsize=7)
    spec = result.get("spec_speedup", {})
    if spec:
        ks = list(spec)
        vals = [spec[k]["speedup"] for k in ks]
        err = [[v - spec[k]["ci95"][0] for k, v in zip(ks, vals)], [spec[k]["ci95"][1] - v for k, v in zip(ks, vals)]]
        axes[2].bar(ks, vals, yerr=err, capsize=4)
        axes[2].axhline(1, color="grey", lw=0.8)
        axes[2].set_ylabel("spec_async / cloud-only tokens/s")
        axes[2].set_title(f"speculative decoding at {result['rtt_ms']:g} ms, by draft runtime")
        axes[2].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cell:
        cell = json.loads(args.cell)
        print(json.dumps(CELLS[cell["kind"]](cell)))
        return 0
    from edgefuse.io import atomic_write_json

    old = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {}
    cells = {k: v for k, v in old.get("cells", {}).items() if "error" not in v}
    t_start = time.perf_counter()

    def write():
        result = {"models": args.models, "prompts": args.prompts, "new_tokens": args.new_tokens,
                  "threads": args.threads, "rtt_ms": args.rtt, "cells": cells,
                  "runtime": [r for m in args.models for r in summarize_model(cells, m, args.threads)],
                  "memory": {k.split("/", 1)[1]: v for k, v in cells.items() if k.startswith("memory/")},
                  "fp32_parity": {k.split("/", 1)[1]: v for k, v in cells.items() if k.startswith("parity/")},
                  "spec_speedup": spec_summary(cells.get("spec", {})),
                  "spec_rows": cells.get("spec", {}).get("rows", []),
                  "wall_seconds": time.perf_counter() - t_start + old.get("wall_seconds", 0),
                  "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                  "command": "python bench/bench_edge.py " + " ".join(sys.argv[1:] if argv is None else argv)}
        atomic_write_json(args.out, result)
        return result

    def do(key, cell):
        if key in cells:
            return
        print(f"{key} ...", flush=True)
        cells[key] = run_cell(cell)
        c = cells[key]
        print(f"  {'ERROR ' + c['error'] if 'error' in c else 'done'} ({c['wall_s']:.0f} s)", flush=True)
        write()

    common = {"prompts": args.prompts, "new_tokens": args.new_tokens, "threads": args.threads}
    for m in args.models if "runtime" in args.parts else []:
        do(f"decode/{m}/torch/fp32", {"kind": "decode", "model": m, "runtime": "torch", "quant": "fp32", **common})
        ref = cells[f"decode/{m}/torch/fp32"].get("greedy")
        for q in args.quants:
            do(f"decode/{m}/onnx/{q}", {"kind": "decode", "model": m, "runtime": "onnx", "quant": q,
                                        "reference": ref, **common})
    for m in args.models if "parity" in args.parts else []:
        do(f"parity/{m}", {"kind": "parity", "model": m, "prompts": args.prompts})
    for m in args.models if "memory" in args.parts else []:
        small = m in ("smollm2-135m", "tiny-llama")
        if small:
            for ckpt in (False, True):
                do(f"memory/{m}/train/torch{'-checkpointing' if ckpt else ''}",
                   {"kind": "memory", "model": m, "phase": "train", "new_tokens": 8, "checkpointing": ckpt})
        ids = prompt_ids_for(m, 2)  # the device gets its prompts in the message: no dataset loaded
        for runtime, q in [("torch", "fp32"), ("onnx", "int8")] + ([("onnx", "int4")] if small else []):
            if runtime == "onnx" and f"memory/{m}/decode/{runtime}-{q}" not in cells:
                from edgefuse.export import export_onnx

                export_onnx(m, q)  # here, not in the measured process (reused when it exists)
            do(f"memory/{m}/decode/{runtime}-{q}", {"kind": "memory", "model": m, "phase": "decode",
                                                     "runtime": runtime, "quant": q, "prompt_ids": ids,
                                                     "new_tokens": args.new_tokens})
        if small:
            from edgefuse.export import export_folder, export_key
            from edgefuse.models import get_spec, model_dir

            tok_file = model_dir(get_spec(m)) / "tokenizer.json"
            do(f"memory/{m}/decode/onnx-int8-lean", {
                "kind": "memory", "model": m, "phase": "decode", "lean": True, "prompt_ids": ids,
                "folder": str(export_folder(m, "int8", export_key(m)[1])), "new_tokens": args.new_tokens,
                "tokenizer": str(tok_file) if tok_file.is_file() else None})
    if "spec" in args.parts:
        do("spec", {"kind": "spec", "prompts": args.spec_prompts, "new_tokens": args.new_tokens,
                    "rtt": args.rtt, "target": args.target, "draft": args.draft, "out": str(args.out)})
    result = write()
    png = plot(result, args.out.with_suffix(".png"))
    for r in result["runtime"]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    print("memory:", {k: round(v.get("peak_rss_mb", 0)) for k, v in result["memory"].items()})
    print("fp32 parity:", {k: v.get("max_abs_logit_diff", v.get("error")) for k, v in result["fp32_parity"].items()})
    print("spec:", result["spec_speedup"])
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
