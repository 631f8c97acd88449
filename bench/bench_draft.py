"""Benchmark cheap drafts for device-side speculative decoding against the cloud target.

Draft Qwen2.5-Coder-0.5B-Instruct (device), target Qwen2.5-Coder-1.5B-Instruct (cloud), both
fp32. Variants of the draft (the drafters of ``edgefuse/cloud/decoding/drafters.py``): the
full LM head; frequency-pruned heads (FR-Spec) keeping the N most frequent ids of a public
corpus; shallow drafts (first L layers + final norm + head, with the full or a pruned head);
prompt-lookup n-grams. For each it measures

- the draft cost per token (ms, median over single-token steps over a KV cache), next to
  the target's cost per token and its cost to verify a block of gamma+1 tokens in one
  forward over a cache;
- greedy acceptance against the target: the target's greedy continuation (``--new-tokens``
  per prompt) is generated once, then at every position the draft's greedy next token given
  the target's prefix is compared with the target's token (per-token acceptance alpha), and
  gamma-token blocks are replayed on that sequence (accepted run length, tokens per block);
- the modelled speculative time per token, (gamma t_draft + RTT + t_verify(gamma)) / E with
  E = (1 - alpha^(gamma+1)) / (1 - alpha) (i.i.d. acceptance, Leviathan et al. 2023), and
  the same replayed on the measured acceptance sequences ("sim"), against remote
  autoregressive decoding (RTT + t_target per token).

Timing runs on ONE torch thread: the device and the cloud are emulated as one core each on
this 2-core machine, and one thread also keeps the figures free of thread-pool noise. The
untimed work (the target's greedy continuations, the teacher-forced draft passes) uses
``--work-threads`` (default 2); it changes nothing but wall time.

Prompts: ``--dolly`` rows of the public Dolly split's evaluation slice (one per category in
turn, prompts of at most ``--max-prompt-tokens``) and the first ``--gsm8k`` GSM8K test
questions, chat-templated with the tokenizer's template (generation prompt on). Token
frequencies come from the main job's draft-head corpus (the public split's ``draft_corpus``
slice, prompt + response) and GSM8K train, never from the evaluated rows.

    python bench/bench_draft.py                 # 8 Dolly + 8 GSM8K prompts, 48 tokens (~12 min here)
    python bench/bench_draft.py --quick         # 2 + 2 prompts, 16 tokens (~3 min)
    python bench/bench_draft.py --heads 8192,16384 --layers 12 --gammas 2,4

Writes the JSON to ``--out`` and a PNG beside it (same stem). Acceptance on 16 prompts x 48
tokens is a small sample (a few hundred positions per variant): read differences of a few
points with that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefuse.io import atomic_write_json  # noqa: E402

DRAFT, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
PLOT_GAMMAS = tuple(range(1, 9))


# ----------------------------------------------------------------------------- data

def default_mirror() -> str | None:
    """The data mirror as every entry point resolves it (edgefuse.config.resolve_paths)."""
    from edgefuse.config import resolve_paths

    mirror = resolve_paths().data_mirror
    return None if mirror is None else str(mirror)


def _prompt_ids(tok, prompt: str) -> list[int]:
    """Token ids of a chat-templated prompt, with ``edgefuse.data.tokenize_example``'s rule
    for special tokens (no second BOS when the template wrote one)."""
    bos = tok.bos_token
    return tok(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]


def _gsm8k(mirror: str, split: str) -> list[dict]:
    path = Path(mirror) / "gsm8k" / f"{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _gsm8k_row(r: dict) -> dict:
    # calculator annotations <<a*b=c>> are not text a model writes
    return {"instruction": r["question"], "context": "",
            "response": re.sub(r"<<[^>]*>>", "", r["answer"])}


def load_prompts(tok, mirror: str, seed: int, n_dolly: int, n_gsm8k: int,
                 max_prompt_tokens: int) -> list[dict]:
    """The evaluated prompts: Dolly rows of the public split's ``eval`` slice
    (:func:`edgefuse.eval.splits.public_slices`, one category in turn, prompts of at most
    ``max_prompt_tokens``), then the first ``n_gsm8k`` GSM8K test questions.

    Returns:
        The prompts, each ``{source, row, ids}``.
    """
    from edgefuse.config import compose
    from edgefuse.data import format_example
    from edgefuse.eval.splits import public_slices

    cfg = compose("default", [f"data.mirror={mirror}", f"seed={seed}"])
    sl = public_slices(cfg.data, int(cfg.seed))
    rows = sl.eval.tolist()
    by_cat: dict[str, list[tuple[int, dict]]] = {}
    for row, r in zip(rows, sl.rows("eval")):
        by_cat.setdefault(r["category"], []).append((row, r))
    cats, taken, prompts = sorted(by_cat), {c: 0 for c in by_cat}, []
    k = 0
    while len(prompts) < n_dolly and any(taken[c] < len(by_cat[c]) for c in cats):
        c = cats[k % len(cats)]
        k += 1
        while taken[c] < len(by_cat[c]):
            row, r = by_cat[c][taken[c]]
            taken[c] += 1
            ids = _prompt_ids(tok, format_example(r, tok)[0])
            if len(ids) <= max_prompt_tokens:
                prompts.append({"source": "dolly", "row": f"dolly/{row} {c}", "ids": ids})
                break
    for j, r in enumerate(_gsm8k(mirror, "test")[:n_gsm8k]):
        ids = _prompt_ids(tok, format_example(_gsm8k_row(r), tok)[0])
        prompts.append({"source": "gsm8k", "row": f"test[{j}]", "ids": ids[-max_prompt_tokens:]})
    return prompts


def frequency_corpus(tok, mirror: str, seed: int) -> list[str]:
    """Public texts for token counting: the draft head's corpus of the main job
    (:func:`edgefuse.cloud.devices.public_corpus`, the public split's ``draft_corpus`` slice,
    disjoint from the evaluated rows) plus every GSM8K train question, chat-templated prompt
    + response."""
    from edgefuse.cloud.devices import public_corpus
    from edgefuse.config import compose
    from edgefuse.data import format_example

    cfg = compose("default", [f"data.mirror={mirror}", f"seed={seed}"])
    texts = public_corpus(cfg.data, int(cfg.seed), tok)
    texts += ["".join(format_example(_gsm8k_row(r), tok)) for r in _gsm8k(mirror, "train")]
    return texts


# ----------------------------------------------------------------------------- target

def greedy_continuation(model, ids: list[int], new_tokens: int, stop: set[int]) -> list[int]:
    """The model's greedy continuation of ``ids`` (stops after a stop token, kept)."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        cache, y = out.cache, []
        while True:
            t = int(out.logits[0, -1].argmax())
            y.append(t)
            if len(y) >= new_tokens or t in stop:
                return y
            out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True, logits_to_keep=1)


def time_target(model, prompts, conts, steps: int, gammas, reps: int) -> dict:
    """Target cost: per token (one token over a cache, median) and per verify block of
    gamma+1 tokens over a cache (full logits for every block position, median)."""
    import torch

    step_ms, verify = [], {g: [] for g in gammas}
    with torch.inference_mode():
        for p, y in zip(prompts, conts):
            ids = p["ids"]
            cache = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).cache
            for i in range(min(steps + 1, len(y))):
                t0 = time.perf_counter()
                out = model(input_ids=torch.tensor([[y[i]]]), cache=cache, use_cache=True)
                out.logits[0, -1].argmax()
                if i:  # the first step warms up
                    step_ms.append(1e3 * (time.perf_counter() - t0))
            base = cache.get_seq_length()
            block = (y * 10)[:max(gammas) + 1]
            for _ in range(reps):
                for g in gammas:
                    t0 = time.perf_counter()
                    out = model(input_ids=torch.tensor([block[:g + 1]]), cache=cache, use_cache=True)
                    out.logits[0].argmax(-1)
                    verify[g].append(1e3 * (time.perf_counter() - t0))
                    cache.crop(base - cache.get_seq_length())  # transformers 5: negative = drop
    return {"ms_per_token": statistics.median(step_ms), "steps": len(step_ms),
            "verify_ms": {g: statistics.median(v) for g, v in verify.items()}}


# ----------------------------------------------------------------------------- drafts

def build_variants(draft, tok, keep: dict, layers: list[int], shallow_heads: list[int]) -> list[dict]:
    """Model-draft variants: ``{name, kind, keep, layers, model, head}``."""
    from edgefuse.cloud.decoding.drafters import DraftHead, shallow_model

    total = draft.config.num_hidden_layers
    out = [{"name": "full", "kind": "full", "keep": None, "layers": total, "model": draft,
            "head": DraftHead(draft)}]
    for n, ids in keep.items():
        out.append({"name": f"fr{n // 1024}k", "kind": "pruned", "keep": n, "layers": total,
                    "model": draft, "head": DraftHead(draft, ids)})
    for L in layers:
        sm = shallow_model(draft, L)
        out.append({"name": f"L{L}", "kind": "shallow", "keep": None, "layers": L, "model": sm,
                    "head": DraftHead(sm)})
        for n in shallow_heads:
            out.append({"name": f"L{L}+fr{n // 1024}k", "kind": "shallow+pruned", "keep": n,
                        "layers": L, "model": sm, "head": DraftHead(sm, keep[n])})
    return out


def teacher_forced_matches(draft, variants, prompts, conts) -> dict[str, list[list[bool]]]:
    """Per variant, per prompt: does the draft's greedy next token, given the target's
    prefix, equal the target's token? One body pass per prompt serves every variant."""
    import torch

    norm = draft.model.norm
    out = {v["name"]: [] for v in variants}
    with torch.inference_mode():
        for p, y in zip(prompts, conts):
            P, m = len(p["ids"]), len(y)
            res = draft.model(input_ids=torch.tensor([p["ids"] + y]), output_hidden_states=True)
            target = torch.tensor(y)
            for v in variants:
                if v["layers"] == draft.config.num_hidden_layers:
                    h = res.last_hidden_state[:, P - 1:P - 1 + m]
                else:  # early exit: layer L's output, then the final norm
                    h = norm(res.hidden_states[v["layers"]][:, P - 1:P - 1 + m])
                pred = v["head"].to_vocab(v["head"].logits(h)[0].argmax(-1))
                out[v["name"]].append((pred == target).tolist())
    return out


def meta_keep(variants, name):
    return next(v["keep"] for v in variants if v["name"] == name)


def meta_layers(variants, name):
    return next(v["layers"] for v in variants if v["name"] == name)


def ngram_matches(drafter, prompts, conts) -> list[list[bool]]:
    return [[drafter.lookup(p["ids"] + y[:i], 1) == [y[i]] for i in range(len(y))]
            for p, y in zip(prompts, conts)]


def time_drafts(variants, drafter, prompts, conts, steps: int, gamma: int) -> dict[str, dict]:
    """Per-token draft cost, round-robin over the variants at every step (same input token,
    the target's, for all), so drift of the machine hits all alike. N-gram: one ``lookup``
    of ``gamma`` tokens, divided by ``gamma``."""
    import torch
    from transformers import DynamicCache

    ms = {v["name"]: [] for v in variants}
    ms["ngram"] = []
    with torch.inference_mode():
        for p, y in zip(prompts, conts):
            caches = {}
            for v in variants:
                _, caches[v["name"]] = v["head"].forward_last(v["model"], torch.tensor([p["ids"]]),
                                                              DynamicCache())
            for i in range(min(steps + 2, len(y))):
                x = torch.tensor([[y[i]]])
                for v in variants:
                    t0 = time.perf_counter()
                    logits, caches[v["name"]] = v["head"].forward_last(v["model"], x, caches[v["name"]])
                    v["head"].to_vocab(logits[0].argmax())
                    if i >= 2:  # two warm-up steps
                        ms[v["name"]].append(1e3 * (time.perf_counter() - t0))
                ctx = p["ids"] + y[:i]
                t0 = time.perf_counter()
                drafter.lookup(ctx, gamma)
                ms["ngram"].append(1e3 * (time.perf_counter() - t0) / gamma)
    return {k: {"ms_per_token": statistics.median(v), "p90_ms": _quantile(v, 0.9), "steps": len(v)}
            for k, v in ms.items()}


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------- model

def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens per block] for i.i.d. acceptance ``alpha``: (1 - a^(g+1)) / (1 - a)."""
    return gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def replay_blocks(conts: list[list[int]], gamma: int, matches: list[list[bool]] | None,
                  ngram=None) -> dict:
    """Speculative rounds replayed on the target's continuations.

    A round at position i drafts up to gamma tokens, accepts the longest run a that equals
    the target's tokens and commits a + 1 tokens (the correction or bonus token). The draft
    comes from ``ngram(prompt_idx, i, gamma)`` when given and it returns a non-empty list
    (the n-gram proposal; an n-gram-only drafter with no match drafts nothing that round),
    else from the model: its greedy drafts, compared through the teacher-forced ``matches``
    (exact for greedy drafting: a draft token only matters while all before it matched).
    Rounds run while a full gamma block fits inside the continuation.

    Returns:
        ``{rounds: [(drafted, accepted, by_model)], mean_accepted, tokens_per_round}``.
    """
    rounds = []
    for k, y in enumerate(conts):
        i = 0
        while i + gamma <= len(y):
            prop = ngram(k, i, gamma) if ngram is not None else None
            if prop or matches is None:
                prop, a = prop or [], 0
                while a < len(prop) and prop[a] == y[i + a]:
                    a += 1
                rounds.append((len(prop), a, False))
            else:
                a = 0
                while a < gamma and matches[k][i + a]:
                    a += 1
                rounds.append((gamma, a, True))
            i += a + 1
    n = max(len(rounds), 1)
    return {"rounds": rounds, "mean_accepted": sum(r[1] for r in rounds) / n,
            "tokens_per_round": sum(r[1] + 1 for r in rounds) / n}


def modelled(t_draft: float, t_ngram: float, alpha: float, rounds, verify, gamma: int,
             rtt: float) -> dict:
    """ms per committed token for one (variant, gamma, RTT).

    ``formula_ms``: (gamma t_draft + RTT + t_verify(gamma)) / E(alpha, gamma), i.i.d.
    acceptance. ``sim_ms``: the replayed rounds' summed cost (model drafting gamma t_draft,
    an n-gram lookup t_ngram per drafted token, RTT, verifying the drafted tokens + 1) over
    the tokens they commit. ``verify(g)`` is the target's time for a block of g + 1 tokens
    (g = 0: one token, remote autoregressive).
    """
    e = expected_tokens(alpha, gamma)
    formula = (gamma * t_draft + rtt + verify(gamma)) / e
    cost = sum(d * (t_draft if by_model else t_ngram) + rtt + verify(d) for d, _, by_model in rounds)
    sim = cost / max(sum(a + 1 for _, a, _ in rounds), 1)
    return {"E": e, "formula_ms": formula, "sim_ms": sim}


def variant_row(name, kind, keep, layers, match_seqs, sources, conts, t_draft, t_ngram,
                gammas, rtts, verify, t_target, ngram=None, model_matches=None) -> dict:
    """Acceptance, replayed rounds and the modelled speed of one draft variant."""
    flat = [b for m in match_seqs for b in m]
    alpha = sum(flat) / max(len(flat), 1)
    by_src = {}
    for src, m in zip(sources, match_seqs):
        by_src.setdefault(src, []).extend(m)
    all_g = sorted(set(gammas) | set(PLOT_GAMMAS))
    replay = {g: replay_blocks(conts, g, model_matches, ngram) for g in all_g}
    ar = {r: r + t_target for r in rtts}

    def table(vfun):
        return {str(r): {str(g): modelled(t_draft, t_ngram, alpha, replay[g]["rounds"], vfun, g, r)
                         for g in all_g} for r in rtts}

    full = table(verify)
    one = table(lambda g: t_target)  # a verify block as cheap as one token (e.g. a GPU)
    best = {}
    for r in rtts:
        g = min(gammas, key=lambda g: full[str(r)][str(g)]["sim_ms"])
        best[str(r)] = {"gamma": g, "sim_ms": full[str(r)][str(g)]["sim_ms"],
                        "speedup": ar[r] / full[str(r)][str(g)]["sim_ms"]}
    by_model = [sum(r[2] for r in replay[g]["rounds"]) / max(len(replay[g]["rounds"]), 1) for g in gammas]
    return {
        "name": name, "kind": kind, "keep": keep, "layers": layers, "draft_ms": t_draft,
        "alpha": alpha, "positions": len(flat),
        "alpha_by_source": {s: sum(m) / max(len(m), 1) for s, m in by_src.items()},
        "mean_accepted_g4": replay[4]["mean_accepted"] if 4 in replay else None,
        "tokens_per_round_sim": {str(g): replay[g]["tokens_per_round"] for g in gammas},
        "rounds_by_model_share": {str(g): v for g, v in zip(gammas, by_model)},
        "E_formula": {str(g): expected_tokens(alpha, g) for g in gammas},
        "model": {r: {g: v for g, v in d.items() if int(g) in gammas} for r, d in full.items()},
        "model_verify_as_one_token": {r: {g: v for g, v in d.items() if int(g) in gammas}
                                      for r, d in one.items()},
        "curve": {r: {g: v["sim_ms"] for g, v in d.items()} for r, d in full.items()},
        "best": best,
    }


def pick_best(rows, rtts, gammas, ar, key="model") -> dict:
    """The (variant, gamma) with the lowest modelled ms/token, by formula and by replay."""
    out = {}
    for r in rtts:
        cands = [(row[key][str(r)][str(g)], row["name"], g) for row in rows for g in gammas]
        f = min(cands, key=lambda c: c[0]["formula_ms"])
        s = min(cands, key=lambda c: c[0]["sim_ms"])
        out[str(r)] = {
            "formula": {"variant": f[1], "gamma": f[2], "ms_per_token": f[0]["formula_ms"],
                        "speedup": ar[str(r)] / f[0]["formula_ms"]},
            "sim": {"variant": s[1], "gamma": s[2], "ms_per_token": s[0]["sim_ms"],
                    "speedup": ar[str(r)] / s[0]["sim_ms"]}}
    return out


# ----------------------------------------------------------------------------- report

def plot(report: dict, path: Path) -> None:
    """Draft ms/token vs acceptance per variant; modelled tokens/s vs gamma at the last RTT."""
    from matplotlib.figure import Figure

    rows = report["variants"]
    rtt = report["settings"]["rtts_ms"][-1]
    fig = Figure(figsize=(13, 5.5), constrained_layout=True)
    ax1, ax2 = fig.subplots(1, 2)
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors
    for k, r in enumerate(rows):
        ax1.scatter(r["draft_ms"], r["alpha"], s=30, color=colors[k % 20])
        ax1.annotate(r["name"], (r["draft_ms"], r["alpha"]), fontsize=8,
                     xytext=(3, 3), textcoords="offset points")
    ax1.set_xlabel("draft cost (ms/token, 1 thread, median)")
    ax1.set_ylabel("greedy acceptance \u03b1 vs target (per token)")
    ax1.set_title(f"draft cost vs acceptance (target: {report['target']['ms_per_token']:.0f} ms/token, "
                  f"verify \u03b3=4: {report['target']['verify_ms']['4']:.0f} ms)", fontsize=10)
    for k, r in enumerate(rows):
        ys = [1e3 / r["curve"][str(rtt)][str(g)] for g in PLOT_GAMMAS]
        ax2.plot(PLOT_GAMMAS, ys, marker="o", ms=3, label=r["name"], color=colors[k % 20])
    ax2.axhline(1e3 / report["autoregressive_ms"][str(rtt)], color="black", ls="--", lw=1,
                label="remote autoregressive")
    ax2.set_xlabel("\u03b3 (drafted tokens per round trip)")
    ax2.set_ylabel("modelled tokens/s")
    ax2.set_title(f"modelled speed at RTT {rtt} ms (rounds replayed on measured acceptance)",
                  fontsize=10)
    ax2.legend(fontsize=7, ncol=2)
    b = report["best"][str(rtt)]["sim"]
    fig.suptitle(f"{report['settings']['draft']} drafting for {report['settings']['target']}: "
                 f"best at {rtt} ms = {b['variant']} \u03b3={b['gamma']} "
                 f"({b['speedup']:.2f}\u00d7 remote AR)", fontsize=10)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def print_table(report: dict) -> None:
    rtts, gam = report["settings"]["rtts_ms"], report["settings"]["gammas"]
    t = report["target"]
    print(f"\n[bench] target {report['settings']['target']}: {t['ms_per_token']:.1f} ms/token; verify "
          + ", ".join(f"\u03b3={g}: {v:.1f}" for g, v in t["verify_ms"].items() if int(g) in gam)
          + " ms; remote AR " + ", ".join(f"RTT {r}: {report['autoregressive_ms'][str(r)]:.0f} ms/token"
                                         for r in rtts))
    head = (f"{'variant':<14}{'keep':>8}{'L':>4}{'ms/tok':>8}{'x tgt':>7}{'alpha':>7}{'run@4':>7}"
            + "".join(f"{'E@' + str(g):>7}" for g in gam)
            + "".join(f"{'best@' + str(r):>10}{'ms/tok':>8}{'speedup':>9}" for r in rtts))
    print(head)
    print("-" * len(head))
    for r in report["variants"]:
        line = (f"{r['name']:<14}{(r['keep'] or '-')!s:>8}{(r['layers'] or '-')!s:>4}"
                f"{r['draft_ms']:>8.2f}{_ratio(t['ms_per_token'], r['draft_ms']):>7}"
                f"{r['alpha']:>7.3f}{r['mean_accepted_g4']:>7.2f}"
                + "".join(f"{r['E_formula'][str(g)]:>7.2f}" for g in gam))
        for rtt in rtts:
            b = r["best"][str(rtt)]
            label = "\u03b3=" + str(b["gamma"])
            line += f"{label:>10}{b['sim_ms']:>8.0f}{b['speedup']:>8.2f}x"
        print(line)
    for key, what in (("best", "measured verify"), ("best_if_verify_as_one_token",
                                                       "if a verify block cost one token")):
        for rtt in rtts:
            bf, bs = report[key][str(rtt)]["formula"], report[key][str(rtt)]["sim"]
            print(f"[bench] {what}, RTT {rtt} ms: best (formula) {bf['variant']} \u03b3={bf['gamma']} "
                  f"{bf['ms_per_token']:.0f} ms/token ({bf['speedup']:.2f}x); best (replayed) "
                  f"{bs['variant']} \u03b3={bs['gamma']} {bs['ms_per_token']:.0f} ms/token "
                  f"({bs['speedup']:.2f}x)")


def _ratio(a: float, b: float) -> str:
    return ">999" if b <= 0 or a / b > 999 else f"{a / b:.1f}"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 + 2 prompts, 16 tokens, fewer timing steps")
    ap.add_argument("--dolly", type=int, default=8, help="public-split Dolly prompts (default 8)")
    ap.add_argument("--gsm8k", type=int, default=8, help="GSM8K test questions (default 8)")
    ap.add_argument("--new-tokens", type=int, default=48, help="target continuation per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--heads", default="4096,8192,16384,32768", help="pruned head sizes N")
    ap.add_argument("--layers", default="12,18", help="shallow drafts: first L layers ('' = none)")
    ap.add_argument("--shallow-heads", default="8192", help="pruned heads also tried on shallow drafts")
    ap.add_argument("--gammas", default="3,4,6,8", help="gammas of the table")
    ap.add_argument("--rtts", default="20,80", help="round-trip times (ms)")
    ap.add_argument("--ngram", default="3,1", help="prompt lookup max_n,min_n")
    ap.add_argument("--hybrid-min-n", type=int, default=2,
                    help="hybrid draft: n-gram proposal when a match this long exists, else the model")
    ap.add_argument("--timing-prompts", type=int, default=2, help="prompts used for timing")
    ap.add_argument("--timing-steps", type=int, default=16, help="timed single-token steps per prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1)")
    ap.add_argument("--work-threads", type=int, default=2, help="torch threads for untimed work")
    ap.add_argument("--mirror", default=default_mirror(), help="offline data mirror")
    ap.add_argument("--seed", type=int, default=0, help="public-split seed (the config's seed)")
    ap.add_argument("--freq-cache", default=None,
                    help="folder for the token-frequency caches (default <edgefuse cache>/draft)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_draft.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.dolly, args.gsm8k, args.new_tokens = 2, 2, 16
        args.timing_prompts, args.timing_steps = 1, 8
    import torch

    from edgefuse.cloud.decoding.drafters import NgramDrafter, frequent_token_ids
    from edgefuse.models import cache_dir, load_model

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    out = Path(args.out).resolve()
    heads, layers, shallow_heads = _ints(args.heads), _ints(args.layers), _ints(args.shallow_heads)
    gammas, rtts = _ints(args.gammas), _ints(args.rtts)
    max_n, min_n = _ints(args.ngram)
    torch.set_num_threads(args.work_threads)

    print(f"[bench] loading {DRAFT} and {TARGET} (fp32) ...", flush=True)
    draft, tok = load_model(DRAFT, allow_fetch=False)
    target, ttok = load_model(TARGET, allow_fetch=False)
    if ttok.get_vocab() != tok.get_vocab():
        raise SystemExit("draft and target tokenizers differ: speculative decoding needs one vocabulary")

    prompts = load_prompts(tok, args.mirror, args.seed, args.dolly, args.gsm8k, args.max_prompt_tokens)
    corpus = frequency_corpus(tok, args.mirror, args.seed)
    freq_dir = Path(args.freq_cache) if args.freq_cache else cache_dir() / "draft"
    keep = {n: frequent_token_ids(tok, corpus, n, freq_dir / f"{DRAFT}-top{n}.json")
            for n in sorted(set(heads) | set(shallow_heads))}
    print(f"[bench] {len(prompts)} prompts ({sum(len(p['ids']) for p in prompts)} prompt tokens), "
          f"frequency corpus {len(corpus)} texts; heads {sorted(keep)}", flush=True)

    stop = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                        tok.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int)}
    t0 = time.perf_counter()
    conts = [greedy_continuation(target, p["ids"], args.new_tokens, stop) for p in prompts]
    print(f"[bench] target continuations: {sum(map(len, conts))} tokens in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    variants = build_variants(draft, tok, {n: keep[n] for n in keep}, layers, shallow_heads)
    variants = [v for v in variants if v["kind"] != "pruned" or v["keep"] in heads]
    matches = teacher_forced_matches(draft, variants, prompts, conts)
    drafter = NgramDrafter(max_n, min_n)
    ngram_seq = ngram_matches(drafter, prompts, conts)

    torch.set_num_threads(args.threads)
    tp = list(range(min(args.timing_prompts, len(prompts))))
    tprompts, tconts = [prompts[i] for i in tp], [conts[i] for i in tp]
    print(f"[bench] timing on {args.threads} thread(s) ...", flush=True)
    tgt = time_target(target, tprompts, tconts, max(4, args.timing_steps // 2),
                      sorted(set(gammas) | set(PLOT_GAMMAS)), reps=2 if args.quick else 3)
    dms = time_drafts(variants, drafter, tprompts, tconts, args.timing_steps, 4)
    torch.set_num_threads(args.work_threads)

    tv, t_target = tgt["verify_ms"], tgt["ms_per_token"]
    ar = {str(r): r + t_target for r in rtts}
    sources = [p["source"] for p in prompts]

    def verify(g):
        return t_target if g == 0 else tv[g]

    common = dict(sources=sources, conts=conts, t_ngram=dms["ngram"]["ms_per_token"], gammas=gammas,
                  rtts=rtts, verify=verify, t_target=t_target)
    rows = [variant_row(v["name"], v["kind"], v["keep"], v["layers"], matches[v["name"]],
                        t_draft=dms[v["name"]]["ms_per_token"], model_matches=matches[v["name"]], **common)
            for v in variants]

    def lookup(d):
        return lambda k, i, g: d.lookup(prompts[k]["ids"] + conts[k][:i], g)

    rows.append(variant_row("ngram", "ngram", None, None, ngram_seq, t_draft=0.0,
                            ngram=lookup(drafter), **common))
    # hybrid: an n-gram match of >= --hybrid-min-n tokens when there is one, else the best model draft
    base = min(rows[:-1], key=lambda r: r["best"][str(rtts[-1])]["sim_ms"])["name"]
    hyb = NgramDrafter(max(max_n, args.hybrid_min_n), args.hybrid_min_n)
    hyb_seq = []
    for k, (p, y) in enumerate(zip(prompts, conts)):
        seq = []
        for i in range(len(y)):
            prop = hyb.lookup(p["ids"] + y[:i], 1)
            seq.append(prop == [y[i]] if prop else matches[base][k][i])
        hyb_seq.append(seq)
    rows.append(variant_row(f"ngram{args.hybrid_min_n}+{base}", "hybrid", meta_keep(variants, base),
                            meta_layers(variants, base), hyb_seq,
                            t_draft=dms[base]["ms_per_token"], ngram=lookup(hyb),
                            model_matches=matches[base], **common))
    for row in rows:
        row["draft_p90_ms"] = dms.get(row["name"], dms.get(base, {})).get("p90_ms")
    best_all = pick_best(rows, rtts, gammas, ar)
    best_one = pick_best(rows, rtts, gammas, ar, "model_verify_as_one_token")
    report = {
        "machine": {"cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {"draft": DRAFT, "target": TARGET, "dtype": "float32", "timing_threads": args.threads,
                     "work_threads": args.work_threads, "new_tokens": args.new_tokens,
                     "gammas": gammas, "rtts_ms": rtts, "ngram": [max_n, min_n],
                     "timing_prompts": len(tp), "timing_steps": args.timing_steps,
                     "max_prompt_tokens": args.max_prompt_tokens, "seed": args.seed,
                     "frequency_corpus_texts": len(corpus)},
        "prompts": [{"source": p["source"], "row": p["row"], "prompt_tokens": len(p["ids"]),
                     "new_tokens": len(y), "text": tok.decode(y)} for p, y in zip(prompts, conts)],
        "target": {"ms_per_token": t_target, "steps": tgt["steps"],
                   "verify_ms": {str(g): v for g, v in sorted(tv.items())}},
        "autoregressive_ms": ar,
        "variants": rows,
        "best": best_all,
        "best_if_verify_as_one_token": best_one,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
    }
    atomic_write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print_table(report)
    print(f"[bench] {report['wall_s']:.0f} s; wrote {out} and {out.with_suffix('.png')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
