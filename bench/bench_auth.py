"""What the authenticated cloud channel costs: the SIGMA-I handshake against the anonymous one.

Measured on loopback, the two kinds interleaved in one run:

1. handshake time (ms; median and IQR over ``--handshakes`` each): ``CloudLink.connect``
   alone, and connect plus a first answered round trip (the cloud answers only once the
   device's IDENTIFY verified); handshake bytes both ways;
2. per-frame bytes of the same request and answer on both kinds of link (identical: the
   frame layer is the same);
3. decoding tokens/s of the default ``spec_sync`` mode at the ``wan20`` / ``wan80`` presets,
   authentication on vs off, paired per prompt and interleaved (the order alternates), the
   default drafter of the main job (``cloud.decode``).

Both services run in this process over ONE target model (two :class:`CloudService` s, one
authenticated with the provisioned keys, one ``insecure_anonymous``), so the pair compared
shares the weights and the CPU. ``--tiny``: random tiny models (a smoke run of the script).

    python bench/bench_auth.py                 # the default cloud pair (qwen2.5-coder 0.5b / 1.5b)
    python bench/bench_auth.py --tiny --handshakes 20 --prompts 1   # smoke
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

from edgefuse.app.device import DeviceHome, keys_root  # noqa: E402
from edgefuse.cloud import protocol as P  # noqa: E402
from edgefuse.cloud.decoding import DecodeConfig, drafter_spec  # noqa: E402
from edgefuse.cloud.devices import pruned_head, run_devices  # noqa: E402
from edgefuse.cloud.link import CloudLink  # noqa: E402
from edgefuse.cloud.service import CloudService, default_service_keys, load_service_keys  # noqa: E402
from edgefuse.cloud.target import Target, tokenizer_fingerprint  # noqa: E402
from edgefuse.config import compose, resolve_paths  # noqa: E402
from edgefuse.eval.queries import dolly_eval_queries, load_gsm8k  # noqa: E402
from edgefuse.io import atomic_write_json  # noqa: E402
from edgefuse.models import load_model, tiny_model  # noqa: E402
from edgefuse.transport.identity import provision  # noqa: E402
from edgefuse.transport.wan import WanProfile  # noqa: E402

TARGET_OVERHEAD_PCT = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edge-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target-model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tiny", action="store_true", help="random tiny qwen2 models (smoke run)")
    p.add_argument("--handshakes", type=int, default=60, help="handshakes of each kind (>= 50)")
    p.add_argument("--presets", nargs="+", default=["wan20", "wan80"])
    p.add_argument("--prompts", type=int, default=3, help="prompts decoded per preset and kind")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mirror", default=None, help="data mirror (default as every entry point)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_auth.json"))
    return p.parse_args(argv)


def _summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"n": len(xs), "median": statistics.median(xs), "q1": q[0], "q3": q[2],
            "iqr": q[2] - q[0], "mean": statistics.fmean(xs)}


def bench_handshakes(n: int, secure_port: int, anon_port: int, keys: dict) -> dict:
    """``n`` handshakes of each kind, alternating; times in ms, bytes on the socket."""
    out = {k: {"connect_ms": [], "first_answer_ms": [], "bytes_up": set(), "bytes_down": set(),
               "request_up": set(), "answer_down": set()} for k in ("authenticated", "anonymous")}
    probe = P.Auth(P.CloudAuth(True, 3))  # answered ERROR protocol (no session): one round trip
    for i in range(n):
        order = ("authenticated", "anonymous") if i % 2 == 0 else ("anonymous", "authenticated")
        for kind in order:
            t0 = time.perf_counter()
            if kind == "authenticated":
                link = CloudLink.connect("127.0.0.1", secure_port, **keys)
            else:
                link = CloudLink.connect("127.0.0.1", anon_port, insecure=True)
            t1 = time.perf_counter()
            up, down = link.bytes_up, link.bytes_down
            try:
                link.request(probe, timeout_s=30)
            except P.RemoteError as exc:
                assert exc.code == "protocol", exc
            t2 = time.perf_counter()
            o = out[kind]
            o["connect_ms"].append((t1 - t0) * 1e3)
            o["first_answer_ms"].append((t2 - t0) * 1e3)
            o["bytes_up"].add(up)
            o["bytes_down"].add(down)
            o["request_up"].add(link.bytes_up - up)
            o["answer_down"].add(link.bytes_down - down)
            link.close()
    res = {}
    for kind, o in out.items():
        res[kind] = {"connect_ms": _summary(o["connect_ms"]),
                     "first_answer_ms": _summary(o["first_answer_ms"]),
                     "handshake_bytes_up": sorted(o["bytes_up"]),
                     "handshake_bytes_down": sorted(o["bytes_down"]),
                     "request_frame_bytes": sorted(o["request_up"]),
                     "answer_frame_bytes": sorted(o["answer_down"]),
                     "raw_connect_ms": o["connect_ms"]}
    return res


def bench_decoding(model, tok, queries, presets, repeats, dcfg, head, spec, secure_port, anon_port,
                   keys) -> list[dict]:
    """One ``spec_sync`` decode per (repeat, preset, prompt, kind); the kind's order alternates."""
    fp = tokenizer_fingerprint(tok)
    rows, pair = [], 0
    for auth in ("on", "off"):  # warm-up, not recorded: first-call costs of both paths
        kw = ({"device_keys": [(keys["identity"], keys["trust"])]} if auth == "on"
              else {"insecure": True})
        run_devices(model, tok, queries[:1], ["spec_sync"], dcfg, "127.0.0.1",
                    secure_port if auth == "on" else anon_port, None, 1, fp, head=head,
                    drafter=spec, **kw)
    for rep in range(repeats):
        for preset in presets:
            wan = WanProfile.from_name(preset)
            for qi, q in enumerate(queries):
                order = ("on", "off") if pair % 2 == 0 else ("off", "on")
                pair += 1
                for auth in order:
                    kw = ({"device_keys": [(keys["identity"], keys["trust"])]} if auth == "on"
                          else {"insecure": True})
                    port = secure_port if auth == "on" else anon_port
                    recs, _ = run_devices(model, tok, [q], ["spec_sync"], dcfg, "127.0.0.1", port,
                                          wan, 1, fp, head=head, drafter=spec, **kw)
                    (r,) = recs
                    res = r.result
                    rows.append({"repeat": rep, "preset": preset, "rtt_ms": wan.rtt_ms,
                                 "prompt": q.qid, "pair": pair - 1, "auth": auth,
                                 "tokens": len(res.tokens), "tokens_per_s": res.tokens_per_s,
                                 "bytes_up_per_token": res.bytes_up_per_token,
                                 "bytes_down_per_token": res.bytes_down_per_token,
                                 "round_trips_per_token": res.round_trips_per_token,
                                 "acceptance_rate": res.acceptance_rate,
                                 "token_ids": list(res.tokens)})
                    print(f"  {preset} {q.qid:<14} auth {auth:<3} {res.tokens_per_s:6.2f} tok/s",
                          flush=True)
    return rows


def decoding_summary(rows: list[dict], presets: list[str], handshake: dict | None = None) -> dict:
    """Per preset: tokens/s on and off (paired), their ratio, and ``implied_overhead_pct``:
    what the authenticated handshake's extra time to a first answer (median, loopback) is of
    one session's decoding time (its tokens / tokens/s, auth off; the frames are the same
    bytes through the same code, so the handshake is the only difference)."""
    extra_ms = None
    if handshake is not None:
        extra_ms = (handshake["authenticated"]["first_answer_ms"]["median"]
                    - handshake["anonymous"]["first_answer_ms"]["median"])
    out = {}
    for preset in presets:
        on = {r["pair"]: r for r in rows if r["preset"] == preset and r["auth"] == "on"}
        off = {r["pair"]: r for r in rows if r["preset"] == preset and r["auth"] == "off"}
        pairs = sorted(set(on) & set(off))
        ratio = [on[p]["tokens_per_s"] / off[p]["tokens_per_s"] for p in pairs]
        same = all(on[p]["token_ids"] == off[p]["token_ids"] for p in pairs)
        bytes_same = all(on[p]["bytes_up_per_token"] == off[p]["bytes_up_per_token"]
                         and on[p]["bytes_down_per_token"] == off[p]["bytes_down_per_token"]
                         for p in pairs)
        out[preset] = {
            "pairs": len(pairs),
            "tokens_per_s_on": _summary([on[p]["tokens_per_s"] for p in pairs]),
            "tokens_per_s_off": _summary([off[p]["tokens_per_s"] for p in pairs]),
            "ratio_on_over_off": _summary(ratio),
            "overhead_pct_median": (1 - statistics.median(ratio)) * 100,
            "overhead_pct_of_means": (1 - statistics.fmean(on[p]["tokens_per_s"] for p in pairs)
                                      / statistics.fmean(off[p]["tokens_per_s"] for p in pairs)) * 100,
            "same_tokens": same, "same_bytes_per_token": bytes_same,
        }
        if extra_ms is not None:
            session_ms = statistics.fmean(off[p]["tokens"] / off[p]["tokens_per_s"] * 1e3
                                          for p in pairs)
            out[preset]["handshake_extra_ms"] = extra_ms
            out[preset]["session_decode_ms_mean"] = session_ms
            out[preset]["implied_overhead_pct"] = extra_ms / session_ms * 100
    return out


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    hs = result["handshake"]
    a.boxplot([hs["authenticated"]["raw_connect_ms"], hs["anonymous"]["raw_connect_ms"]],
              showfliers=False)
    a.set_xticks([1, 2], ["SIGMA-I", "anonymous"])
    a.set_ylabel("connect (ms, loopback)")
    nbytes = {k: hs[k]["handshake_bytes_up"][0] + hs[k]["handshake_bytes_down"][0] for k in hs}
    a.set_title(f"handshake: {nbytes['authenticated']} vs {nbytes['anonymous']} B")
    presets = list(result["decoding"])
    x = range(len(presets))
    on = [result["decoding"][p]["tokens_per_s_on"]["median"] for p in presets]
    off = [result["decoding"][p]["tokens_per_s_off"]["median"] for p in presets]
    b.bar([i - 0.2 for i in x], on, 0.4, label="auth on")
    b.bar([i + 0.2 for i in x], off, 0.4, label="auth off")
    b.set_xticks(list(x), [f"{p}\n{result['decoding'][p]['overhead_pct_median']:+.1f} %" for p in presets])
    b.set_ylabel("spec_sync tokens/s (median of pairs)")
    b.set_title(f"{result['edge_model']} -> {result['target_model']}")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.handshakes < 50 and not args.tiny:
        raise SystemExit("--handshakes must be >= 50")
    torch.set_num_threads(args.threads)
    cfg = compose("default")
    resolve_paths(cfg, data_mirror=args.mirror)
    provision(keys_root(), 1)
    identity, authorized = load_service_keys(*default_service_keys(keys_root()))
    home = DeviceHome.of({"partition-id": 0})
    keys = {"identity": home.identity(), "trust": home.trust()}
    if args.tiny:
        (target, ttok), (model, tok) = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
        args.edge_model = args.target_model = "tiny-qwen2"
        spec, head = drafter_spec(cfg.cloud), None
        spec = type(spec)("full_head")
    else:
        target, ttok = load_model(args.target_model)
        model, tok = load_model(args.edge_model)
        spec = drafter_spec(cfg.cloud)
        head = pruned_head(model, tok, cfg.data, int(cfg.seed), spec.head_size, cfg.paths.cache_dir)
    queries = (load_gsm8k(cfg.data.mirror, args.prompts, int(cfg.seed))
               + dolly_eval_queries(cfg.data, int(cfg.seed), 1))[:args.prompts]
    tgt = Target(target.eval(), ttok, args.target_model)
    svc_kw = {"max_wait_ms": float(cfg.cloud.service.max_wait_ms)}
    secure = CloudService(tgt, "127.0.0.1", 0, identity=identity, authorized=authorized, **svc_kw)
    anon = CloudService(tgt, "127.0.0.1", 0, insecure_anonymous=True, **svc_kw)
    secure.start_in_thread()
    anon.start_in_thread()
    t_start = time.perf_counter()
    busy = Path("/tmp/bm/busy")
    busy.parent.mkdir(parents=True, exist_ok=True)
    busy.touch()
    try:
        print(f"{args.handshakes} handshakes of each kind (loopback) ...", flush=True)
        hs = bench_handshakes(args.handshakes, secure.port, anon.port, keys)
        dcfg = DecodeConfig(max_new_tokens=args.max_new_tokens, timeout_s=600,
                            gamma_max=int(cfg.cloud.decode.gamma_max))
        print(f"spec_sync, {len(queries)} prompts x {args.presets} x auth on/off ...", flush=True)
        rows = bench_decoding(model, tok, queries, args.presets, args.repeats, dcfg, head, spec,
                              secure.port, anon.port, keys)
    finally:
        busy.unlink(missing_ok=True)
        secure.stop()
        anon.stop()
    dec = decoding_summary(rows, args.presets, hs)
    worst = max(d["overhead_pct_median"] for d in dec.values())
    result = {
        "edge_model": args.edge_model, "target_model": args.target_model,
        "drafter": spec.name, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "prompts": [q.qid for q in queries], "repeats": args.repeats,
        "handshake": hs, "decoding": dec, "decoding_rows": rows,
        "target": {"decoding_overhead_pct_max": TARGET_OVERHEAD_PCT,
                   "worst_median_overhead_pct": worst, "met": worst <= TARGET_OVERHEAD_PCT,
                   "worst_implied_overhead_pct": max(d["implied_overhead_pct"] for d in dec.values()),
                   "note": "the measured pairs carry the noise of a shared 2-core machine; the "
                           "implied overhead is the handshake's measured extra time over the "
                           "session's decoding time"},
        "wall_seconds": time.perf_counter() - t_start,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg": os.getloadavg(), "torch": torch.__version__},
        "command": "python bench/bench_auth.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    png = plot(result, out.with_suffix(".png"))
    a, n = hs["authenticated"], hs["anonymous"]
    print(f"\nhandshake connect ms median (IQR): SIGMA-I {a['connect_ms']['median']:.2f} "
          f"({a['connect_ms']['iqr']:.2f}), anonymous {n['connect_ms']['median']:.2f} "
          f"({n['connect_ms']['iqr']:.2f}); first answer {a['first_answer_ms']['median']:.2f} vs "
          f"{n['first_answer_ms']['median']:.2f}")
    print(f"handshake bytes up/down: SIGMA-I {a['handshake_bytes_up']}/{a['handshake_bytes_down']}, "
          f"anonymous {n['handshake_bytes_up']}/{n['handshake_bytes_down']}; request/answer frame "
          f"bytes {a['request_frame_bytes']}/{a['answer_frame_bytes']} vs "
          f"{n['request_frame_bytes']}/{n['answer_frame_bytes']}")
    for p, d in dec.items():
        print(f"{p}: tokens/s on {d['tokens_per_s_on']['median']:.2f} off "
              f"{d['tokens_per_s_off']['median']:.2f} (median of {d['pairs']} pairs), overhead "
              f"{d['overhead_pct_median']:+.2f} % (of means {d['overhead_pct_of_means']:+.2f} %), "
              f"same tokens {d['same_tokens']}; the handshake's extra "
              f"{d['handshake_extra_ms']:.2f} ms is {d['implied_overhead_pct']:.4f} % of a session")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
