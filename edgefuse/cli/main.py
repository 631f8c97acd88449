"""``edgefuse`` command line.

    edgefuse models list                  registered models and whether they are cached
    edgefuse models fetch [NAME ...]      download + verify + convert (default: the edge SLMs)
    edgefuse models export NAME [--adapter DIR] [--quant int8]   ONNX for the edge profile (cached)
    edgefuse fusers list REGISTRY_DIR     fuser versions in a registry (e.g. <run>/fusers)
    edgefuse fusers export --registry DIR --version ID --out FILE [--sign-key KEY --signer NAME]   one (signed) archive
    edgefuse fusers trust --trust FILE NAME PUBLIC_HEX   pin an exporter's key
    edgefuse fusers import --registry DIR --trust FILE ARCHIVE   check a signed fuser archive and register it
    edgefuse run [HYDRA OVERRIDES ...]    the main job: a Flower simulation (`flwr run`)
    edgefuse run --multirun training.lr=1e-4,3e-4   a Hydra sweep, one output folder per job
    edgefuse cloud serve --model NAME [--port 39200 ...]   the cloud LLM service (until SIGINT/SIGTERM)
    edgefuse cloud health [--host H --port P]              a running service's status (JSON)
    edgefuse cloud generate --mode MODE [--prompt TEXT]    complete a prompt / chat through the cloud link
    edgefuse keys init --partitions N [--root DIR]        identities and pins of the cloud and N devices
    edgefuse keys new --device-dir DIR                   a device's (or an exporter's) own identity
    edgefuse keys register device-N PUBLIC_HEX [--root DIR]   pin a key a device made itself
    edgefuse keys show [--device-dir DIR | --root DIR]    names, fingerprints and pins
    edgefuse keys safety-number A B [--root DIR | --device-dir DIR]   the number two operators compare
    edgefuse deploy certs --out DIR [--host NAME ...]     a CA and the SuperLink's TLS certificate
    edgefuse deploy supernode-keys --out DIR --nodes N     SuperNode authentication key pairs
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from edgefuse.cli.common import CLIError, Parser, one_line, quote_override
from edgefuse.config import resolve_paths
from edgefuse.models import REGISTRY, ModelFetchError, ModelSpecError, fetch, is_fetched, model_dir

EDGE_SLMS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
CACHE_HELP = "model cache root (default: paths.cache_dir, $EDGEFUSE_CACHE, ~/.cache/edgefuse)"


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (:func:`edgefuse.config.positive_int`)."""
    from edgefuse.config import ConfigError, positive_int

    try:
        positive_int(text, "the value")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return int(text)


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the value must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"the value must be an integer >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0 = any free one where a server binds)."""
    value = _count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port must be in 0..65535, got {text!r}")
    return value


def _new_tokens(text: str) -> int:
    """An argparse type: tokens to generate, 1..MAX_NEW_TOKENS."""
    from edgefuse.cloud.decoding.config import MAX_NEW_TOKENS

    value = _positive(text)
    if value > MAX_NEW_TOKENS:
        raise argparse.ArgumentTypeError(f"the value must be at most {MAX_NEW_TOKENS}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the value must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"the value must be a finite number of seconds > 0, got {text!r}")
    return value


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _models(argv: list[str]) -> int:
    parser = Parser(prog="edgefuse models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="registered models and their cache state")
    ls.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    f = sub.add_parser("fetch", help="download, verify and convert embedded models once")
    f.add_argument("names", nargs="*", help=f"default: {' '.join(EDGE_SLMS)}")
    f.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    e = sub.add_parser("export", help="export a model to ONNX for the edge device profile (cached by "
                                      "model, quantization and adapter hash)")
    e.add_argument("name", help="a registered model name (edgefuse models list)")
    e.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA folder (a run's adapters/round_NNN/<model>) merged before export")
    e.add_argument("--quant", default="int8", choices=["fp32", "int8", "int4"],
                   help="weight quantization (default int8: MatMulNBits, 32 weights per scale)")
    e.add_argument("--force", action="store_true", help="rebuild even when the export is cached")
    e.add_argument("--threads", type=_positive, default=None, help="torch threads while building")
    e.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    args = parser.parse_args(argv)
    cache = resolve_paths(cache_dir=args.cache_dir).cache_dir
    if args.cmd == "export":
        from edgefuse.export import check_exportable, export_onnx, load_adapted
        from edgefuse.runtime import ProfileError

        try:
            check_exportable(args.name, args.quant)  # before any weight is loaded
            model, tok = load_adapted(args.name, args.adapter, cache) if args.adapter else (None, None)
            ex = export_onnx(args.name, args.quant, model=model, tok=tok, root=cache, force=args.force,
                             threads=args.threads)
        except (ModelSpecError, ModelFetchError, ProfileError, ValueError) as e:
            raise CLIError(e) from None
        how = "cached, reused" if ex.reused else f"built in {ex.export_s:.1f} s"
        print(f"{args.name} {args.quant} (adapter {ex.adapter}): {ex.folder} ({how})")
        return 0
    if args.cmd == "list":
        from rich.console import Console
        from rich.table import Table

        table = Table(title="edgefuse models")
        for col in ("name", "architecture", "hub id", "cached", "license"):
            table.add_column(col, no_wrap=col in ("name", "cached"))
        for spec in REGISTRY.values():
            if spec.tiny:
                cached = "built in"
            elif is_fetched(spec, cache):
                cached = "yes"
            else:
                cached = "incomplete: re-fetch" if model_dir(spec, cache).exists() else "no"
            table.add_row(spec.name, spec.arch, spec.hub_id or "-", cached, spec.license_note or "-")
        Console(width=None if sys.stdout.isatty() else 160).print(table)
        return 0
    for name in args.names or EDGE_SLMS:
        try:
            path = fetch(name, cache)
        except (ModelSpecError, ModelFetchError) as e:
            raise CLIError(e) from None
        print(f"{name}: {path}")
    return 0


def _fusers(argv: list[str]) -> int:
    parser = Parser(prog="edgefuse fusers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="every fuser version in a registry folder (from the cards; "
                                     "weights are verified when a fuser is loaded)")
    ls.add_argument("registry", help="a registry folder, e.g. outputs/<run>/fusers")
    ex = sub.add_parser("export", help="write one fuser version as a single archive file "
                                       "(checked first: a corrupted version is not exported)")
    ex.add_argument("--registry", required=True, help="the registry folder holding the version")
    ex.add_argument("--version", required=True, help="the version id (16 hex, see `fusers list`)")
    ex.add_argument("--out", required=True, help="the archive to write (a .tar)")
    ex.add_argument("--sign-key", default=None, help="sign the archive with this Ed25519 identity "
                    "key (PEM, mode 0600; e.g. the identity.key `edgefuse keys new` makes)")
    ex.add_argument("--signer", default=None, help="the name the signature is made under, which "
                    "importers pin (default: exporter; needs --sign-key)")
    im = sub.add_parser("import", help="check a fuser archive (signature, members, sizes, card "
                                       "digests, config hash, shapes, finite values) and register it")
    im.add_argument("--registry", required=True, help="the registry folder to import into "
                                                      "(created if missing), e.g. c2c.registry_dir")
    im.add_argument("archive", help="an archive written by `edgefuse fusers export`")
    im.add_argument("--cache-dir", default=None, help=CACHE_HELP + "; the card's models must be "
                    "here (they give the fuser's shapes; nothing is fetched)")
    im.add_argument("--trust", default=None, help="a trust.json pinning the exporters whose "
                    "signatures are accepted (see `fusers trust`)")
    im.add_argument("--allow-unsigned", action="store_true", help="also import an archive that "
                    "is not signed (its digests are checked, but nothing says who made it)")
    tr = sub.add_parser("trust", help="pin an exporter's public key (as a signed export prints it)")
    tr.add_argument("--trust", required=True, help="the trust.json to pin it in (created if missing)")
    tr.add_argument("name", help="the exporter's signer name (`fusers export --signer`)")
    tr.add_argument("public_key", help="the exporter's 64-hex public key")
    tr.add_argument("--replace", action="store_true", help="replace another key already pinned "
                                                            "for the name")
    args = parser.parse_args(argv)
    from pathlib import Path

    from edgefuse.c2c.registry import DEFAULT_SIGNER, FuserIntegrityError, FuserRegistry, FuserVersionError
    from edgefuse.transport.identity import IdentityError, TrustStore, fingerprint, load_identity, public_from_hex

    if args.cmd == "export" and args.signer is not None and args.sign_key is None:
        parser.error("--signer needs --sign-key")
    if args.cmd == "trust":
        try:
            key = public_from_hex(args.public_key)
            store = TrustStore.load(Path(args.trust).expanduser())
            same = args.name in store.names() and store.get(args.name) == key
            store.pin(args.name, key, replace=args.replace)
            path = store.save()
        except (IdentityError, OSError) as e:
            raise CLIError(e) from None
        state = "already pinned" if same else "pinned"
        print(f"{args.name:<12} {fingerprint(key)}  {state} in {path}")
        return 0
    if args.cmd in ("export", "import"):
        reg = FuserRegistry(args.registry)
        try:
            if args.cmd == "export":
                if not reg.root.is_dir():
                    raise CLIError(f"no registry folder {reg.root}")
                signer = load_identity(Path(args.sign_key).expanduser()) if args.sign_key else None
                name = (args.signer or DEFAULT_SIGNER) if signer else None
                path = reg.export(reg.find(args.version), args.out, signer=signer, signer_name=name)
                print(f"exported fuser {args.version} to {path}")
                if signer:
                    public = signer.public_bytes().hex()
                    print(f"signed as {name}: public key {public}  fingerprint {signer.fingerprint}")
                    print(f"the importer pins it once: edgefuse fusers trust --trust FILE {name} {public}")
                return 0
            trust = None
            if args.trust is not None:
                if not Path(args.trust).expanduser().is_file():
                    raise CLIError(f"no trust file {args.trust} (pin an exporter with "
                                   "`edgefuse fusers trust --trust FILE NAME PUBLIC_KEY`)")
                trust = TrustStore.load(Path(args.trust).expanduser())
            had = {p.name for p in reg.root.glob("*/*") if p.is_dir()}  # no card is read
            cache = resolve_paths(cache_dir=args.cache_dir).cache_dir
            version = reg.import_(args.archive, cache_dir=cache, trust=trust,
                                  allow_unsigned=args.allow_unsigned)
        except (FuserVersionError, IdentityError) as e:
            raise CLIError(e) from None
        except OSError as e:
            raise CLIError(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
        state = "already in the registry, nothing written" if version.id in had else "imported"
        print(f"fuser {version.id} ({version.sharer.spec} -> {version.receiver.spec}): {state} "
              f"({reg.path(version)})")
        return 0

    from rich.console import Console
    from rich.table import Table

    root = Path(args.registry)
    if not root.is_dir():
        raise CLIError(f"no registry folder {root}")
    reg = FuserRegistry(root)
    try:
        cards = reg.list()
    except FuserIntegrityError as e:
        raise CLIError(e) from None
    table = Table(title=f"fusers in {reg.root}")
    for col in ("sharer", "receiver", "version", "latest", "params", "MB", "steps", "val loss", "alone"):
        table.add_column(col, justify="left" if col in ("sharer", "receiver", "version") else "right")
    for c in cards:
        latest = reg.latest(c.sharer_spec, c.receiver_spec)
        scores = c.scores or {}
        fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
        table.add_row(c.sharer_spec, c.receiver_spec, c.version_id,
                      "yes" if latest is not None and latest.id == c.version_id else "",
                      f"{c.params:,}", f"{c.bytes / 1e6:.2f}", str(c.train_steps),
                      fmt(scores.get("val_loss")), fmt(scores.get("alone_val_loss")))
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def _cloud(argv: list[str]) -> int:
    parser = Parser(prog="edgefuse cloud")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve a target LLM to devices (framed TCP, see edgefuse.cloud.service)")
    s.add_argument("--model", required=True, help="a registered model name (edgefuse models list)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=39200, help="TCP port, 0 = any free one (default 39200)")
    s.add_argument("--max-batch", type=int, default=8, help="jobs per forward pass, at most (default 8)")
    s.add_argument("--max-wait-ms", type=float, default=100.0,
                   help="ms the batcher waits at most to fill a batch after its first job; it stops "
                        "early once every open session is in (default 100)")
    s.add_argument("--max-sessions", type=int, default=64,
                   help="sessions open at once; more get ERROR busy (default 64)")
    s.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--max-context", type=_positive, default=2048, help="tokens per session, at most (default 2048)")
    s.add_argument("--max-connections", type=int, default=128,
                   help="connections open at once; more are closed on accept (default 128)")
    s.add_argument("--idle-timeout-s", type=float, default=300.0,
                   help="s without a valid message before a connection and its session close (default 300)")
    s.add_argument("--handshake-timeout-s", type=float, default=10.0,
                   help="s a new connection has from accept to the device's verified identity (default 10)")
    s.add_argument("--max-frame-bytes", type=int, default=65536,
                   help="largest message body accepted, checked before it is read (default 65536)")
    s.add_argument("--max-pending", type=int, default=4,
                   help="requests per connection waiting for the model, at most (default 4)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for the model in all, at most (default 256)")
    s.add_argument("--max-draft", type=int, default=16,
                   help="drafted tokens per VERIFY, at most; more get ERROR limit (default 16)")
    s.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="token rows per forward pass, at most (>= --max-context; default 8192)")
    s.add_argument("--backend", default="embedded", choices=["embedded", "vllm"],
                   help="embedded: the model in this process; vllm: a vLLM server runs it (default embedded)")
    s.add_argument("--vllm-python", default=None,
                   help="vllm: the python of vLLM's own virtual environment (this starts its server)")
    s.add_argument("--vllm-url", default=None, help="vllm: a running vLLM OpenAI server's URL instead")
    s.add_argument("--vllm-arg", action="append", default=[],
                   help="vllm: one more server flag, e.g. --vllm-arg=--tensor-parallel-size=2 (repeatable)")
    s.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt ids per prefill chunk, other sessions' batches run between "
                        "chunks (0 = a whole prefill at once; default 0)")
    s.add_argument("--row-padding", default="auto",
                   help="how a forward's new-token rows are padded: auto (measure this machine's "
                        "cost per row count once, cached beside the models, and pad to the cheapest "
                        "count at or above), none, or an int m (pad 2..m-1 rows to m) (default auto)")
    s.add_argument("--max-handshakes", type=int, default=None,
                   help="connections not yet authenticated at once; more are closed on accept "
                        "(default min(32, --max-connections))")
    s.add_argument("--identity", default=None,
                   help="the service's Ed25519 identity key (default <keys root>/cloud/identity.key)")
    s.add_argument("--authorized-devices", default=None,
                   help="the devices it serves (default <keys root>/cloud/authorized_devices.json)")
    s.add_argument("--insecure-anonymous", action="store_true",
                   help="anonymous handshake only, no identities (benchmark comparison only; "
                        "authenticated devices are refused)")
    s.add_argument("--split-policy", default=None,
                   help='serve split inference under this JSON policy, e.g. \'{"allowed": "any", '
                        '"head_split": true, "acts": ["int8", "float16"]}\' (default: no split inference)')
    s.add_argument("--port-file", default=None, help="write the bound port here once listening")
    s.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="logging level on stderr (default INFO)")
    s.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    h = sub.add_parser("health", help="print a running service's status as JSON (every counter "
                                      "with the service's token in $EDGEFUSE_CLOUD_HEALTH_TOKEN)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=_port, default=39200)
    h.add_argument("--timeout", type=_seconds, default=5.0, help="seconds (default 5)")
    g = sub.add_parser("generate", help="complete a prompt (--prompt) or chat through the cloud link")
    g.add_argument("--mode", default="spec_async", choices=["all", "edge", "cloud", "spec_sync", "spec_async",
                                                            "fusion_static", "fusion_adaptive", "split",
                                                            "split_spec"],
                   help="the decoding mode (default spec_async); all = every mode but split and "
                        "split_spec, which load the target's layers and are asked by name")
    g.add_argument("--prompt", default=None, help="one prompt; without it: an interactive chat")
    g.add_argument("--model", default="qwen2.5-coder-0.5b", help="the edge model (default qwen2.5-coder-0.5b)")
    g.add_argument("--adapter", default=None, help="a PEFT adapter folder (a run's adapters/round_NNN/<model>)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_port, default=39200)
    g.add_argument("--wan", default="none", help="emulated link: none, lan, wan20, wan80 (default none)")
    g.add_argument("--max-new-tokens", type=_new_tokens, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--gamma", type=_count, default=None, help="fixed draft length (default: adaptive)")
    g.add_argument("--draft-head", type=_count, default=0, help="frequency-pruned draft head size (0 = full)")
    g.add_argument("--fusion-weight", type=float, default=0.5, help="edge weight of static fusion")
    g.add_argument("--confidence", default="entropy", choices=["entropy", "margin"])
    g.add_argument("--deadline-ms", type=float, default=1000.0, help="per fused token (ms)")
    g.add_argument("--protection", default=None, choices=["off", "none", "redact", "rephrase", "both"],
                   help="how each prompt is protected on the device before it goes toward the cloud "
                        "(none = off; default: the main job's privacy.protection, both)")
    g.add_argument("--flag-cache", default=None, action=argparse.BooleanOptionalAction,
                   help="whether the cloud may keep the session's KV cache between requests "
                        "(default: privacy.cloud_auth.flag_cache, yes)")
    g.add_argument("--l-cache", type=int, default=None,
                   help="the most past tokens the cloud may keep and attend to "
                        "(default: privacy.cloud_auth.l_cache, unlimited)")
    g.add_argument("--target", default="qwen2.5-coder-1.5b",
                   help="the cloud's model: its tokenizer, when not the edge model's, for decoding "
                        "across vocabularies; split modes: its first and last layers run here "
                        "(default qwen2.5-coder-1.5b)")
    g.add_argument("--split-k", type=_count, default=2, help="split modes: the target's first layers here (default 2)")
    g.add_argument("--split-m", type=_count, default=2, help="split modes: its last layers here (default 2)")
    g.add_argument("--split-act", default="int8", choices=["int8", "float16"],
                   help="split modes: activations on the link (default int8, per-row scales)")
    g.add_argument("--head-split", type=_positive, default=None,
                   help="split modes: hold only the head's first S columns; the cloud scores the rest "
                        "(default: the whole head here)")
    g.add_argument("--mask", default=None, choices=["full", "english", "ascii", "corpus"],
                   help="with --head-split: the vocabulary the cloud scores; other tokens are never emitted "
                        "(corpus: the --mask-size most frequent tokens of the public corpus, sent once)")
    g.add_argument("--mask-size", type=_positive, default=32768,
                   help="with --mask corpus: how many tokens it keeps (default 32768)")
    g.add_argument("--head-topk", type=_count, default=0,
                   help="with --head-split: 0 = the whole mask 8-bit (default), k = its top-k")
    g.add_argument("--fill", default="drop", choices=["drop", "bound"],
                   help="with --head-topk: a mask token the cloud did not send is left out (drop, "
                        "default) or scored at an upper bound of its logit (bound)")
    g.add_argument("--stream-block", type=_count, default=0,
                   help="split modes: prompt rows per pipelined MID (default 0 = the whole prompt in one)")
    g.add_argument("--split-adapter", default=None, metavar="DIR",
                   help="split modes: a PEFT LoRA folder merged into the target layers run here "
                        "(it never leaves the device)")
    g.add_argument("--profile", default="cpu", choices=["cpu", "edge"],
                   help="the device runtime: cpu = PyTorch float32 (default), edge = the model (with "
                        "--adapter merged) exported to ONNX and run by ONNX Runtime")
    g.add_argument("--quant", default="int8", choices=["fp32", "int8", "int4"],
                   help="with --profile edge: the export's weights (default int8)")
    g.add_argument("--threads", type=_positive, default=None, help="torch (and ONNX Runtime) CPU threads")
    g.add_argument("--device-dir", default=None,
                   help="the device home whose identity and pinned cloud key authenticate the link "
                        "(default <keys root>/devices/partition-0)")
    g.add_argument("--trust-on-first-use", action="store_true",
                   help="if the device home pins no cloud key yet, print the cloud's fingerprint and pin it")
    g.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    g.add_argument("--data-mirror", default=None,
                   help="data mirror for --draft-head's corpus (default: data.mirror, $EDGEFUSE_DATA_MIRROR, "
                        "../shared/data, the hub; 'hub' = the hub)")
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        from edgefuse.app.device import DeviceHome
        from edgefuse.cloud.chat import run

        if args.device_dir is None:
            args.device_dir = str(DeviceHome.of({"partition-id": 0}).path)
        from edgefuse.cloud.decoding import DecodeError
        from edgefuse.models import ModelFetchError, ModelSpecError

        from edgefuse.cloud.protocol import RemoteError

        try:
            return run(args)
        except (DecodeError, ModelSpecError, ModelFetchError, FileNotFoundError, ValueError,
                RemoteError, RuntimeError) as e:  # RuntimeError: e.g. an adapter of another model, the hub
            raise CLIError(e) from None
    if args.cmd == "health":
        import json

        from edgefuse.cloud.link import CloudUnavailable, cloud_health

        try:
            status = cloud_health(args.host, args.port, args.timeout,
                                  token=os.environ.get("EDGEFUSE_CLOUD_HEALTH_TOKEN") or None)
        except CloudUnavailable as e:
            raise CLIError(e, status=1) from None
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    import logging

    from edgefuse.app.device import keys_root
    from edgefuse.cloud.service import default_service_keys, serve
    from edgefuse.models import ModelFetchError, ModelSpecError
    from edgefuse.transport.identity import IdentityError

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # serve() loads through edgefuse.models.cache_dir(), which reads EDGEFUSE_CACHE
    os.environ["EDGEFUSE_CACHE"] = str(resolve_paths(cache_dir=args.cache_dir).cache_dir)
    default_identity, default_authorized = default_service_keys(keys_root())
    split_policy = None
    if args.split_policy is not None:
        import json

        try:
            split_policy = json.loads(args.split_policy)
        except json.JSONDecodeError as e:
            raise CLIError(f"--split-policy is not JSON: {e}") from None
    try:
        serve(args.model, args.host, args.port, max_batch=args.max_batch,
              max_wait_ms=args.max_wait_ms, max_sessions=args.max_sessions, threads=args.threads,
              max_context=args.max_context, port_file=args.port_file,
              max_connections=args.max_connections, idle_timeout_s=args.idle_timeout_s,
              handshake_timeout_s=args.handshake_timeout_s, max_frame_bytes=args.max_frame_bytes,
              max_pending=args.max_pending, max_queue=args.max_queue, max_draft=args.max_draft,
              max_batch_tokens=args.max_batch_tokens, max_handshakes=args.max_handshakes,
              identity_path=args.identity or default_identity,
              authorized_path=args.authorized_devices or default_authorized,
              insecure_anonymous=args.insecure_anonymous, split_policy=split_policy,
              prefill_chunk=args.prefill_chunk, backend=args.backend, vllm_python=args.vllm_python,
              vllm_url=args.vllm_url, vllm_args=args.vllm_arg, row_padding=args.row_padding)
    except (ModelSpecError, ModelFetchError, IdentityError, ValueError, OSError, RuntimeError) as e:
        raise CLIError(e) from None  # RuntimeError: a vLLM server that would not start or answer
    return 0


def _keys(argv: list[str]) -> int:
    """``edgefuse keys init | new | register | show | safety-number``: the identities
    (:mod:`edgefuse.transport.identity`) under a keys root (default
    :func:`edgefuse.app.device.keys_root`)."""
    from pathlib import Path

    from edgefuse.app.device import keys_root
    from edgefuse.transport.identity import (AUTHORIZED_FILE, CLOUD, IDENTITY_FILE, PUBLIC_FILE, TRUST_FILE, IdentityError,
                                             TrustStore,
                                             check_name, cloud_dir, device_dir, fingerprint, load_identity,
                                             provision, public_from_hex, read_public, register_public, safety_number)

    root_help = "keys root (default: $EDGEFUSE_KEYS, else <edgefuse cache>/identity)"
    parser = Parser(prog="edgefuse keys")
    sub = parser.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="make (or keep) the cloud's and N devices' identities and pins")
    i.add_argument("--partitions", type=int, required=True, help="number of devices (partition ids 0..N-1)")
    i.add_argument("--root", default=None, help=root_help)
    k = sub.add_parser("new", help="on a device: make (or keep) its own identity; prints the public key to register")
    k.add_argument("--device-dir", required=True, help="the device's own folder")
    r = sub.add_parser("register", help="operator: pin a key a device made itself (then run init again)")
    r.add_argument("name", help="device-<pid>")
    r.add_argument("public_key", help="the 64-hex public key `edgefuse keys new` printed on the device")
    r.add_argument("--root", default=None, help=root_help)
    s = sub.add_parser("show", help="one identity's name and fingerprint, and the keys it pins")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--device-dir", default=None, help="a device's own folder (identity.key, trust.json)")
    where.add_argument("--root", default=None, help=root_help + "; shows every identity under it")
    n = sub.add_parser("safety-number", help="the number the operators of two ends compare out of band")
    n.add_argument("name_a", help="cloud or device-<pid>")
    n.add_argument("name_b", help="cloud or device-<pid>")
    n_where = n.add_mutually_exclusive_group()
    n_where.add_argument("--root", default=None, help=root_help)
    n_where.add_argument("--device-dir", default=None,
                         help="a device's own folder: its own key and the keys it pins (what its operator compares)")
    args = parser.parse_args(argv)
    root = Path(args.root).expanduser().resolve() if getattr(args, "root", None) else keys_root()

    def folder(name: str) -> Path:
        check_name(name)
        if name == CLOUD:
            return cloud_dir(root)
        pid = name.removeprefix("device-")
        if not name.startswith("device-") or not pid.isdigit():
            raise IdentityError(f"unknown name {name!r}: use {CLOUD} or device-<partition id>")
        return device_dir(root, int(pid))

    def own(path: Path) -> tuple:
        if not (path / IDENTITY_FILE).exists():
            raise IdentityError(f"no identity at {path / IDENTITY_FILE}")
        ident = load_identity(path / IDENTITY_FILE)
        store = TrustStore.load(path / (AUTHORIZED_FILE if (path / AUTHORIZED_FILE).exists() else TRUST_FILE))
        return ident, store, store.find(ident.public_bytes()) or path.name

    def public(name: str) -> bytes:
        if args.device_dir:  # this device's own key, else the key it pins for the name
            ident, store, me = own(Path(args.device_dir).expanduser().resolve())
            return ident.public_bytes() if name == me else store.get(check_name(name))
        path = folder(name)
        if not (path / IDENTITY_FILE).exists() and not (path / PUBLIC_FILE).exists():
            raise IdentityError(f"no identity for {name} at {path / IDENTITY_FILE} (edgefuse keys init --root {root})")
        return read_public(path)

    def show(path: Path, name: str | None = None) -> None:
        ident, store, me = own(path)
        print(f"{name or me}  {ident.fingerprint}  ({path})")
        for pinned in store.names():
            print(f"  pins {pinned:<12} {fingerprint(store.get(pinned))}")

    try:
        if args.cmd == "init":
            for name, fp in provision(root, args.partitions).items():
                print(f"{name:<12} {fp}")
            print(f"keys root: {root}")
            return 0
        if args.cmd == "new":
            ident = load_identity(Path(args.device_dir).expanduser().resolve() / IDENTITY_FILE, create=True)
            print(f"public key {ident.public_bytes().hex()}  fingerprint {ident.fingerprint}")
            print("give the operator the public key: edgefuse keys register device-<pid> <public key>")
            return 0
        if args.cmd == "register":
            pid = folder(args.name).name.removeprefix("partition-")
            if args.name == CLOUD:
                raise IdentityError("register pins a device's key; the cloud's identity is made by init")
            key = public_from_hex(args.public_key)
            path = register_public(root, int(pid), key)
            print(f"{args.name:<12} {fingerprint(key)}  ({path}); now run: edgefuse keys init "
                  f"--partitions N --root {root}, and give the device its trust.json")
            return 0
        if args.cmd == "safety-number":
            a, b = public(args.name_a), public(args.name_b)
            print(f"{args.name_a} <-> {args.name_b}: {safety_number(a, b)}")
            return 0
        if args.device_dir:
            show(Path(args.device_dir).expanduser().resolve())
            return 0
        homes = [(cloud_dir(root), CLOUD)] + sorted(
            ((p, f"device-{p.name.removeprefix('partition-')}") for p in (root / "devices").glob("partition-*")
             if p.name.removeprefix("partition-").isdigit()),
            key=lambda x: int(x[0].name.removeprefix("partition-")))
        homes = [(p, name) for p, name in homes if (p / IDENTITY_FILE).exists()]
        if not homes:
            raise IdentityError(f"no identities under {root} (edgefuse keys init --partitions N --root {root})")
        for path, name in homes:
            show(path, name)
        return 0
    except (IdentityError, OSError) as e:
        raise CLIError(e) from None


def _check_run_overrides(items: list[str]) -> None:
    """Compose the config of ``edgefuse run``'s first job before Hydra starts, so a bad
    override is one line here, not Hydra's report. A sweep (``a=1,2``) is checked with its
    first value; Hydra's own flags and ``hydra.*`` overrides are left to Hydra.

    Raises:
        CLIError: an override that does not parse, an unknown key or group option, or a
            value a check refuses (:func:`edgefuse.app.phases.compose`).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from edgefuse.app.phases import compose
    from edgefuse.config import ConfigError

    parser = OverridesParser.create()
    job = []
    for item in items:
        if item.startswith("-") or "=" not in item or item.lstrip("+~").startswith("hydra"):
            continue
        try:
            o = parser.parse_overrides([item])[0]
        except Exception as e:  # hydra's OverrideParseException and friends
            raise CLIError(f"bad override {item!r}: {one_line(e)}") from None
        if o.is_sweep_override():
            first = next(o.sweep_string_iterator())
            plain = all(c.isalnum() or c in "._-+/:" for c in first)
            first = first if plain else quote_override(first)
            job.append(f"{o.get_key_element()}={first}")
        else:
            job.append(item)
    try:
        compose("default", job)
    except (ConfigError, ModelSpecError) as e:
        raise CLIError(e) from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgefuse`` console script. Every failure is one line on stderr
    (``edgefuse: error: ...``) and a non-zero exit status, never a traceback; set
    ``EDGEFUSE_DEBUG=1`` for the traceback of an unexpected error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not sys.stderr.isatty():  # logs and scripts: no weight-loading bars before an error line
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        if argv[0] == "models":
            return _models(argv[1:])
        if argv[0] == "fusers":
            return _fusers(argv[1:])
        if argv[0] == "cloud":
            return _cloud(argv[1:])
        if argv[0] == "keys":
            return _keys(argv[1:])
        if argv[0] == "deploy":
            from edgefuse.cli.deploy import main as deploy_main

            return deploy_main(argv[1:])
        if argv[0] == "run":
            if not any(a in ("-h", "--help", "--hydra-help") for a in argv[1:]):
                _check_run_overrides(argv[1:])
            from edgefuse.cli.launch import hydra_main

            sys.argv = [sys.argv[0], *argv[1:]]
            return hydra_main() or 0
        raise CLIError(f"unknown command {argv[0]!r}: use models, fusers, run, cloud, keys or deploy (edgefuse --help)")
    except CLIError as e:
        print(f"edgefuse: error: {one_line(e)}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print("edgefuse: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure: still one line
        if os.environ.get("EDGEFUSE_DEBUG"):
            raise
        print(f"edgefuse: error: {type(e).__name__}: {one_line(e)} (EDGEFUSE_DEBUG=1 shows the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
