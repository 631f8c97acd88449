"""Fuser import / export (FuserRegistry.export, FuserRegistry.import_): a version trained on
another machine travels as one archive and is registered only after every check.

Each attack below is a crafted archive; each must be refused with one clear line and leave
the target registry exactly as it was (empty). The fusers are tiny-llama -> tiny-qwen2
(random weights, bottleneck 8: ~3 k parameters), so the tiny models' configs give the shapes.
"""

import hashlib
import io
import json
import tarfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from edgefuse.c2c.fuser import C2CFuser, FuserConfig, kv_spec_from_config
from edgefuse.c2c.registry import (ARCHIVE_MEMBERS, FORMAT_VERSION, SIGNATURE, FuserArchiveError,
                                   FuserCard, FuserIntegrityError, FuserRegistry, FuserVersion,
                                   FuserVersionError, ModelVersion, archive_message, config_hash,
                                   pair_name, state_digest)
from edgefuse.models import model_config
from edgefuse.transport.identity import Identity, IdentityError, TrustStore, fingerprint

SHARER, RECEIVER = "tiny-llama", "tiny-qwen2"
FCFG = FuserConfig(bottleneck=8)
ELSEWHERE = {"host": "gpu-box", "device": "cuda:0 (NVIDIA H200)", "torch": "2.13.0", "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def kv():
    return {s: kv_spec_from_config(model_config(s)) for s in (SHARER, RECEIVER)}


def version(fcfg=FCFG, receiver_hash="0123456789abcdef"):
    return FuserVersion(ModelVersion(SHARER, "base"), ModelVersion(RECEIVER, receiver_hash),
                        config_hash(fcfg.to_dict()))


def random_fuser(kv, seed=0, fcfg=FCFG):
    fuser = C2CFuser(kv[RECEIVER], kv[SHARER], fcfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fuser.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return fuser


def exported(tmp_path, kv, seed=0, name="a.tar", mutate=None, signer=None, signer_name=None):
    """Save a random fuser in a fresh 'remote' registry and export it (signed by ``signer``
    when given); ``(archive, state, card)``."""
    fuser = random_fuser(kv, seed)
    if mutate:
        mutate(fuser)
    src = FuserRegistry(tmp_path / f"remote-{name}")
    v = version()
    src.save(fuser, FCFG.to_dict(), v, FuserCard.for_version(
        v, train_steps=500, train_examples=4000, data="public split, 4000 prompts",
        scores={"val_loss": 2.1, "alone_val_loss": 2.4}, trained_on=ELSEWHERE))
    state, _, card = src.load_state(v)
    return src.export(v, tmp_path / name, signer=signer, signer_name=signer_name), state, card


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def build(path: Path, entries, fmt=tarfile.USTAR_FORMAT) -> Path:
    """A tar of ``entries``: ``(name, bytes)`` regular files or ready ``TarInfo``s."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry)
            else:
                info = tarfile.TarInfo(entry[0])
                info.size = len(entry[1])
                tar.addfile(info, io.BytesIO(entry[1]))
    return path


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def refused(tmp_path, archive, match, error=FuserArchiveError, **kw) -> str:
    """Import ``archive`` into a fresh registry: it must raise ``error`` matching ``match``
    on one line, and the registry must hold nothing afterwards (not even a hidden folder).
    Unsigned archives are allowed unless ``allow_unsigned=False`` is passed."""
    reg = FuserRegistry(tmp_path / "run")
    kw.setdefault("allow_unsigned", True)  # these attacks are on the contents, not the signer
    with pytest.raises(error, match=match) as info:
        reg.import_(archive, **kw)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 400
    assert tree(reg.root) == []
    return msg


# ---------------------------------------------------------------- round trip


def test_export_import_round_trip_is_bit_identical(tmp_path, kv):
    archive, state, card = exported(tmp_path, kv)
    assert members(archive).keys() == set(ARCHIVE_MEMBERS)
    with tarfile.open(archive) as tar:
        assert [m.name for m in tar.getmembers()] == list(ARCHIVE_MEMBERS)
        assert all(m.isreg() for m in tar.getmembers())
    reg = FuserRegistry(tmp_path / "run")
    v = reg.import_(archive, allow_unsigned=True)
    assert v == version() and reg.latest(SHARER, RECEIVER) == v
    got_state, got_config, got_card = reg.load_state(v)
    assert got_card == card and got_card.trained_on == ELSEWHERE
    assert got_card.format_version == FORMAT_VERSION and got_config == FCFG.to_dict()
    assert got_state.keys() == state.keys()
    assert all(torch.equal(got_state[k], state[k]) for k in state)
    remote = FuserRegistry(tmp_path / "remote-a.tar").path(v)
    for name in ARCHIVE_MEMBERS:  # the very bytes, not a re-serialisation
        assert (reg.path(v) / name).read_bytes() == (remote / name).read_bytes()
    assert reg.find(v.id) == v

    # the same archive again: a no-op, nothing rewritten
    before = {p: p.stat().st_mtime_ns for p in reg.path(v).iterdir()}
    assert reg.import_(archive, allow_unsigned=True) == v
    assert {p: p.stat().st_mtime_ns for p in reg.path(v).iterdir()} == before
    assert tree(reg.root) == sorted([reg.path(v).parent.name, f"{reg.path(v).parent.name}/latest",
                                     str(reg.path(v).relative_to(reg.root))]
                                    + [str((reg.path(v) / n).relative_to(reg.root)) for n in ARCHIVE_MEMBERS])

    # export of the imported version gives the same archive bytes
    assert reg.export(v, tmp_path / "again.tar").read_bytes() == archive.read_bytes()


def test_export_refuses_a_corrupted_version(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    reg = FuserRegistry(tmp_path / "run")
    v = reg.import_(archive, allow_unsigned=True)
    blob = bytearray((reg.path(v) / "fuser.safetensors").read_bytes())
    blob[-1] ^= 1
    (reg.path(v) / "fuser.safetensors").write_bytes(bytes(blob))
    with pytest.raises(FuserIntegrityError, match="tampered"):
        reg.export(v, tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists()
    with pytest.raises(FuserVersionError, match="no fuser version 00000000000000ff"):
        reg.find("00000000000000ff")


def test_a_format_1_card_still_loads(tmp_path, kv):
    reg = FuserRegistry(tmp_path / "reg")
    v = version()
    reg.save(random_fuser(kv), FCFG.to_dict(), v, FuserCard.for_version(v))
    card_path = reg.path(v) / "card.json"
    d = json.loads(card_path.read_text())
    assert d["trained_on"]["torch"] == torch.__version__
    del d["trained_on"]
    d["format_version"] = 1
    card_path.write_text(json.dumps(d))
    assert reg.load_state(v)[2].trained_on == {}
    d["trained_on"] = {"host": "x" * 201}
    card_path.write_text(json.dumps(d))
    with pytest.raises(FuserIntegrityError, match="trained_on"):
        reg.load_state(v)


# ---------------------------------------------------------------- attacks on the contents


def test_a_tampered_weight_byte_is_refused(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    raw = bytearray(archive.read_bytes())
    m = members(archive)
    at = raw.find(m["fuser.safetensors"]) + len(m["fuser.safetensors"]) - 3  # inside the tensor data
    raw[at] ^= 0x10
    archive.write_bytes(bytes(raw))
    refused(tmp_path, archive, "sha256 .* tampered", FuserIntegrityError)


def recarded(tmp_path, archive, state, name, extra=()):
    """An archive whose weights are ``state`` and whose card's digests, sizes were recomputed
    to match them (what an attacker who can write the card does); ``extra`` members follow."""
    m = members(archive)
    blob = st_save(state)
    card = json.loads(m["card.json"])
    params = sum(t.numel() for t in state.values())
    card.update(weights_sha256=hashlib.sha256(blob).hexdigest(), state_sha256=state_digest(state),
                params=params, bytes=4 * params)
    return build(tmp_path / name, [("card.json", json.dumps(card).encode()),
                                   ("config.json", m["config.json"]), ("fuser.safetensors", blob),
                                   *extra])


def test_a_recomputed_card_for_weights_of_other_shapes_is_refused(tmp_path, kv):
    archive, state, _ = exported(tmp_path, kv)
    key = next(k for k, v in state.items() if v.ndim == 2 and v.shape[0] != v.shape[1])
    # same parameter count, one matrix transposed: digests match the card, shapes do not
    swapped = dict(state, **{key: state[key].t().contiguous()})
    msg = refused(tmp_path, recarded(tmp_path, archive, swapped, "t.tar"), "has shape")
    assert key in msg
    # another bottleneck's weights (fewer parameters) under this config
    small = C2CFuser(kv[RECEIVER], kv[SHARER], FuserConfig(bottleneck=4)).state_dict()
    refused(tmp_path, recarded(tmp_path, archive, small, "s.tar"),
            r"card says \d+ parameters .* a fuser of this pair and config has")
    # a renamed tensor
    renamed = {("layers.999." + k.split(".", 2)[2] if k == key else k): v for k, v in state.items()}
    refused(tmp_path, recarded(tmp_path, archive, renamed, "r.tar"), "missing .* unexpected")
    # float64 weights
    doubled = {k: v.double() for k, v in state.items()}
    refused(tmp_path, recarded(tmp_path, archive, doubled, "d.tar"), "float64")


def test_a_nan_weight_is_refused(tmp_path, kv):
    def poison(fuser):
        with torch.no_grad():
            next(p for p in fuser.parameters() if p.ndim == 2)[0, 0] = float("nan")

    archive, _, _ = exported(tmp_path, kv, mutate=poison)
    refused(tmp_path, archive, "NaN or Inf")


def test_a_config_that_builds_no_fuser_is_refused(tmp_path, kv):
    archive, _, card = exported(tmp_path, kv)
    m = members(archive)

    def with_config(config, name):
        c = json.loads(m["card.json"])
        c["config_hash"] = config_hash(config)
        v = FuserVersion(ModelVersion(c["sharer_spec"], c["sharer_adapter_hash"]),
                         ModelVersion(c["receiver_spec"], c["receiver_adapter_hash"]), c["config_hash"])
        c["version_id"] = v.id
        return build(tmp_path / name, [("card.json", json.dumps(c).encode()),
                                       ("config.json", json.dumps(config).encode()),
                                       ("fuser.safetensors", m["fuser.safetensors"])])

    refused(tmp_path, with_config(dict(FCFG.to_dict(), bottleneck=0), "z.tar"), "not a fuser config")
    refused(tmp_path, with_config(dict(FCFG.to_dict(), extra=1), "e.tar"), "not a fuser config")
    # a huge bottleneck: the reference fuser is built on the meta device, nothing allocated
    tracemalloc.start()
    refused(tmp_path, with_config(dict(FCFG.to_dict(), bottleneck=10 ** 9), "h.tar"),
            "a fuser of this pair and config has")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2 ** 20
    # a config edited without updating the card's hash
    edited = build(tmp_path / "c.tar", [("card.json", m["card.json"]),
                                        ("config.json", json.dumps(dict(FCFG.to_dict(), bottleneck=4)).encode()),
                                        ("fuser.safetensors", m["fuser.safetensors"])])
    refused(tmp_path, edited, "config altered")


@pytest.mark.parametrize("spec,match", [("nobody/unknown-model", "nobody/unknown-model"),
                                        ("gemma3-270m", "not in the cache"),
                                        ("not a model", "unknown model")])
def test_a_model_this_machine_does_not_hold_is_refused_without_fetching(tmp_path, kv, monkeypatch,
                                                                         spec, match):
    import huggingface_hub

    import edgefuse.models

    def no_fetch(*a, **kw):
        raise AssertionError("an import must never fetch a model")

    monkeypatch.setattr(edgefuse.models, "fetch", no_fetch)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_fetch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    c = json.loads(m["card.json"])
    c["sharer_spec"] = spec
    v = FuserVersion(ModelVersion(spec, "base"),
                     ModelVersion(c["receiver_spec"], c["receiver_adapter_hash"]), c["config_hash"])
    c.update(version_id=v.id, pair=pair_name(spec, RECEIVER))
    bad = build(tmp_path / "u.tar", [("card.json", json.dumps(c).encode()),
                                     ("config.json", m["config.json"]),
                                     ("fuser.safetensors", m["fuser.safetensors"])])
    msg = refused(tmp_path, bad, f"cannot get the KV shapes of the sharer model {spec!r}",
                  cache_dir=tmp_path / "empty-cache")
    assert match in msg


def test_a_card_without_save_record_or_inconsistent_is_refused(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    # the last: the file's sha256 is right but the state digest clients check is not
    for i, edit in enumerate(({"weights_sha256": ""}, {"version_id": "0" * 16},
                              {"format_version": FORMAT_VERSION + 1}, {"state_sha256": "0" * 64})):
        c = dict(json.loads(m["card.json"]), **edit)
        bad = build(tmp_path / f"c{i}.tar", [("card.json", json.dumps(c).encode()),
                                             ("config.json", m["config.json"]),
                                             ("fuser.safetensors", m["fuser.safetensors"])])
        refused(tmp_path, bad, ("no registry save record", "card edited", "upgrade edgefuse",
                                "state digest .* differs from the card's")[i], FuserIntegrityError)
    nan_card = m["card.json"].replace(b'"val_loss": 2.1', b'"val_loss": NaN')
    assert nan_card != m["card.json"]
    refused(tmp_path, build(tmp_path / "n.tar", [("card.json", nan_card), ("config.json", m["config.json"]),
                                                 ("fuser.safetensors", m["fuser.safetensors"])]),
            "not strict UTF-8 JSON")
    refused(tmp_path, build(tmp_path / "deep.tar", [("card.json", b"[" * 60000),
                                                    ("config.json", m["config.json"]),
                                                    ("fuser.safetensors", m["fuser.safetensors"])]),
            "not strict UTF-8 JSON")


def test_an_existing_different_version_is_never_overwritten(tmp_path, kv):
    first, state, _ = exported(tmp_path, kv, seed=0, name="first.tar")
    other, _, _ = exported(tmp_path, kv, seed=1, name="other.tar")  # same version id, other weights
    reg = FuserRegistry(tmp_path / "run")
    v = reg.import_(first, allow_unsigned=True)
    files = {n: (reg.path(v) / n).read_bytes() for n in ARCHIVE_MEMBERS}
    with pytest.raises(FuserVersionError, match=f"version {v.id} is already in the registry .* "
                                                "never overwritten"):
        reg.import_(other, allow_unsigned=True)
    assert {n: (reg.path(v) / n).read_bytes() for n in ARCHIVE_MEMBERS} == files
    assert not [p for p in reg.path(v).parent.iterdir() if p.name.startswith(".")]
    assert all(torch.equal(reg.load_state(v)[0][k], state[k]) for k in state)


# ---------------------------------------------------------------- attacks on the archive


@pytest.mark.parametrize("evil", ["../x", "/etc/x", "a/../../x"])
def test_a_path_traversal_member_is_refused(tmp_path, kv, evil):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    bad = build(tmp_path / "p.tar", [(evil, b"owned"), *m.items()])
    refused(tmp_path, bad, "absolute or parent path")
    assert not (tmp_path / "x").exists() and not Path("/etc/x").exists()


@pytest.mark.parametrize("kind,what", [(tarfile.SYMTYPE, "symbolic link"), (tarfile.LNKTYPE, "hard link"),
                                       (tarfile.DIRTYPE, "folder")])
def test_a_link_member_is_refused(tmp_path, kv, kind, what):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    link = tarfile.TarInfo("card.json")
    link.type, link.linkname = kind, "/etc/passwd"
    bad = build(tmp_path / "l.tar", [link, ("config.json", m["config.json"]),
                                     ("fuser.safetensors", m["fuser.safetensors"])])
    refused(tmp_path, bad, f"'card.json/?' is a {what}, not a regular file")


def test_an_extra_member_is_refused(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    bad = build(tmp_path / "e.tar", [*members(archive).items(), ("notes.txt", b"hi")])
    refused(tmp_path, bad, "unexpected member 'notes.txt'")
    # a missing member
    m = members(archive)
    del m["config.json"]
    refused(tmp_path, build(tmp_path / "m.tar", m.items()), "lacks config.json")
    # data hidden after the end of the archive
    hidden = tmp_path / "h.tar"
    hidden.write_bytes(archive.read_bytes() + b"\x00" * 512 + b"payload")
    refused(tmp_path, hidden, "data after the end-of-archive block")


def test_a_duplicate_member_is_refused(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    bad = build(tmp_path / "d.tar", [*m.items(), ("card.json", m["card.json"])])
    refused(tmp_path, bad, "'card.json' appears twice")


def test_an_oversized_member_is_refused_before_reading(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    # a header declaring 4 GiB of weights and no data behind it: the file stays tiny
    info = tarfile.TarInfo("fuser.safetensors")
    info.size = 4 * 2 ** 30
    raw = build(tmp_path / "head.tar", [("card.json", m["card.json"]),
                                        ("config.json", m["config.json"])]).read_bytes()
    end = sum(512 + -(-len(m[n]) // 512) * 512 for n in ("card.json", "config.json"))
    bomb = tmp_path / "bomb.tar"
    bomb.write_bytes(raw[:end] + info.tobuf(tarfile.USTAR_FORMAT) + bytes(1024))
    assert bomb.stat().st_size < 10_000
    tracemalloc.start()
    refused(tmp_path, bomb, r"'fuser.safetensors' declares 4294967296 bytes, more than the \d+ "
                            "allowed; refused before reading")
    assert tracemalloc.get_traced_memory()[1] < 10 * 2 ** 20
    tracemalloc.stop()
    # a card declared larger than a card may be
    big = tarfile.TarInfo("card.json")
    big.size = 2 ** 20
    bomb.write_bytes(big.tobuf(tarfile.USTAR_FORMAT) + bytes(1024))
    refused(tmp_path, bomb, "'card.json' declares 1048576 bytes")
    # weights padded far past what the card's fuser needs (digests recomputed): refused by size
    c = json.loads(m["card.json"])
    padded = m["fuser.safetensors"] + b" " * 2 ** 20
    c["weights_sha256"] = hashlib.sha256(padded).hexdigest()
    fat = build(tmp_path / "fat.tar", [("card.json", json.dumps(c).encode()), ("config.json", m["config.json"]),
                                       ("fuser.safetensors", padded)])
    refused(tmp_path, fat, r"more than the \d+ its card's fuser needs")
    # an archive file larger than any fuser archive may be
    refused(tmp_path, fat, "more than a fuser archive may be", max_weights_bytes=1000)


def test_other_archive_formats_are_refused(tmp_path, kv):
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    long = "x" * 120  # needs a pax header in PAX format
    pax = build(tmp_path / "pax.tar", [(long, b"1"), *m.items()], fmt=tarfile.PAX_FORMAT)
    refused(tmp_path, pax, "pax extended header")
    gnu = build(tmp_path / "gnu.tar", [*m.items()], fmt=tarfile.GNU_FORMAT)
    refused(tmp_path, gnu, "not a POSIX ustar archive")
    gz = tmp_path / "a.tar.gz"
    with tarfile.open(gz, "w:gz", format=tarfile.USTAR_FORMAT) as tar:
        tar.add(archive, arcname="card.json")
    refused(tmp_path, gz, "not a POSIX ustar archive")
    raw = bytearray(archive.read_bytes())
    raw[0] ^= 1  # first byte of the first name: the header checksum no longer matches
    archive.write_bytes(bytes(raw))
    refused(tmp_path, archive, "bad header checksum")
    refused(tmp_path, tmp_path / "missing.tar", "cannot read the fuser archive")
    refused(tmp_path, tmp_path, "is not a regular file")


# ---------------------------------------------------------------- an imported version is served


def test_an_imported_fuser_is_served_cached_and_accepted_by_the_client(tmp_path, kv, monkeypatch):
    """A fuser trained 'elsewhere' for the run's exact model versions and fuser config, imported
    into the run's registry: the service reports the pair ``cached`` (no training), serves the
    imported weights bit for bit, and the receiving client's handler installs it."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
    from types import SimpleNamespace
    import time

    from edgefuse.app.handlers import c2c as handler
    from edgefuse.c2c import hub
    from edgefuse.c2c.hub import FuserService, Side, kv_spec
    from edgefuse.c2c.registry import pack_state
    from edgefuse.config import compose, lora_targets
    from edgefuse.lora import attach_lora, get_adapter_state, set_adapter_state
    from edgefuse.models import tiny_model

    cfg = compose("tiny", ["c2c.fuser.bottleneck=8", f"c2c.registry_dir={tmp_path / 'run'}"])
    # the receiving client: tiny-llama with a non-zero LoRA adapter, as in a federation
    model, tok = tiny_model("llama", seed=0)
    peft = attach_lora(model, rank=4, alpha=16.0, dropout=0.0,
                       target_modules=lora_targets(cfg, SHARER), seed=0)
    rng = np.random.default_rng(0)
    set_adapter_state(peft, {k: (rng.normal(0, 0.05, v.shape).astype(np.float32) if ".lora_B." in k else v)
                             for k, v in get_adapter_state(peft).items()})
    client = SimpleNamespace(entry=SimpleNamespace(model=SHARER), slot={"peft": peft, "tok": tok}, cfg=cfg)
    sides = {SHARER: Side(SHARER, 0, get_adapter_state(peft), 4, 16.0),
             RECEIVER: Side(RECEIVER, 1, None, 4, 16.0)}
    pair = (RECEIVER, SHARER)  # tiny-qwen2 shares into the tiny-llama client

    # trained elsewhere: the remote registry holds the version this run will ask for
    svc = FuserService(cfg, FuserRegistry(cfg.c2c.registry_dir))
    version = svc.version(sides[RECEIVER], sides[SHARER])
    fuser = C2CFuser(kv_spec(cfg, SHARER), kv_spec(cfg, RECEIVER), svc.fcfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in fuser.parameters():
            p.copy_(0.01 * torch.randn(p.shape, generator=g))
    remote = FuserRegistry(tmp_path / "remote")
    remote.save(fuser, svc.fcfg_dict, version, FuserCard.for_version(
        version, train_steps=20_000, train_examples=500_000, data="elsewhere", trained_on=ELSEWHERE))
    remote_state, _, remote_card = remote.load_state(version)
    archive = remote.export(version, tmp_path / "fuser.tar")
    assert svc.registry.import_(archive, allow_unsigned=True) == version

    def no_training(*a, **kw):
        raise AssertionError("an imported fuser must not be retrained")

    monkeypatch.setattr(hub, "train_fuser", no_training)
    monkeypatch.setattr(hub, "load_public_copy", no_training)
    (row,) = svc.update(sides, [pair], round_idx=3)
    assert row["action"] == "cached", row.get("reason")
    assert row["version"] == version.id and row["train_steps"] == 20_000
    assert row["params"] == remote_card.params == fuser.num_parameters()

    # what the server sends (edgefuse.app.phases.c2c): the imported weights, bit for bit
    state, config, card = svc.registry.load_state(version)
    assert card == remote_card and card.trained_on == ELSEWHERE
    assert all(torch.equal(state[k], remote_state[k]) for k in remote_state)
    packed, index = pack_state(state)
    meta = {"card": card.to_json(), "config": config, "index": index,
            "receiver_kv": kv_spec(cfg, SHARER).to_dict(), "sharer_kv": kv_spec(cfg, RECEIVER).to_dict()}
    content = RecordDict({"c2c": ConfigRecord({"sharers": [RECEIVER], f"meta.{RECEIVER}": json.dumps(meta)}),
                          f"fuser.{RECEIVER}": ArrayRecord({k: Array(v) for k, v in packed.items()})})
    msg = Message(content=content, metadata=Metadata(
        run_id=1, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="",
        created_at=time.time(), ttl=60.0, message_type="query.fusers"))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert handler.install_fusers(msg, ctx, client)["installed"] == [RECEIVER]
    installed, got_card = handler.load_fuser(ctx, client, RECEIVER)
    assert got_card == remote_card
    assert all(torch.equal(installed.state_dict()[k], remote_state[k]) for k in remote_state)


def test_an_imported_control_fuser_never_becomes_the_pairs_latest(tmp_path, kv):
    """A zero-sharer control exported elsewhere and imported here is registered but, as when
    the hub saves one, never the pair's latest (load_for would serve it as the real fuser)."""
    zero = FuserConfig(bottleneck=8, sharer_control="zero")
    archive, _, _ = exported(tmp_path, kv)
    src = FuserRegistry(tmp_path / "remote-zero")
    v = version(zero)
    src.save(random_fuser(kv, 1, zero), zero.to_dict(), v,
             FuserCard.for_version(v, train_steps=500, train_examples=4000, data="public split"),
             make_latest=False)
    control = src.export(v, tmp_path / "zero.tar")
    reg = FuserRegistry(tmp_path / "run")
    assert reg.import_(control, allow_unsigned=True) == v and reg.latest(SHARER, RECEIVER) is None
    real = reg.import_(archive, allow_unsigned=True)
    assert reg.import_(control, allow_unsigned=True) == v and reg.latest(SHARER, RECEIVER) == real
    assert reg.load_state(v)[1]["sharer_control"] == "zero"


# ---------------------------------------------------------------- signed archives
# The exporter 'gpu-box' signs with its identity; the importer pins that key by name. Each
# attack below is refused with one line and leaves the target registry empty.

EXPORTER = "gpu-box"


@pytest.fixture(scope="module")
def exporter():
    return Identity.generate()


@pytest.fixture
def trust(exporter):
    return TrustStore({EXPORTER: exporter.public_bytes()})


def signed(tmp_path, kv, exporter, seed=0, name="s.tar"):
    return exported(tmp_path, kv, seed=seed, name=name, signer=exporter, signer_name=EXPORTER)


def resign(tmp_path, archive, identity, signer, name):
    """``archive``'s three members re-signed by ``identity`` under ``signer`` (what an
    attacker holding some key does)."""
    m = members(archive)
    files = {n: m[n] for n in ARCHIVE_MEMBERS}
    doc = {"format": 1, "signer": signer, "public_key": identity.public_bytes().hex(),
           "signature": identity.sign(archive_message(signer, files)).hex()}
    return build(tmp_path / name, [*files.items(), (SIGNATURE, json.dumps(doc).encode())])


def test_a_signed_export_imports_with_the_pinned_key(tmp_path, kv, exporter, trust):
    archive, state, card = signed(tmp_path, kv, exporter)
    with tarfile.open(archive) as tar:
        assert [m.name for m in tar.getmembers()] == [*ARCHIVE_MEMBERS, SIGNATURE]
        assert all(m.isreg() for m in tar.getmembers())
    m = members(archive)
    doc = json.loads(m[SIGNATURE])
    assert doc["format"] == 1 and doc["signer"] == EXPORTER
    assert doc["public_key"] == exporter.public_bytes().hex() and len(doc["signature"]) == 128
    # what is signed: the prefix, the name, the sha256 of card, config and weights in order
    message = (b"edgefuse fuser archive v1\x00" + EXPORTER.encode() + b"\x00"
               + b"".join(hashlib.sha256(m[n]).digest() for n in ("card.json", "config.json",
                                                                  "fuser.safetensors")))
    assert archive_message(EXPORTER, m) == message and len(message) == 26 + 8 + 96
    assert exporter.sign(message).hex() == doc["signature"]

    reg = FuserRegistry(tmp_path / "run")
    v = reg.import_(archive, trust=trust)
    assert v == version() and reg.latest(SHARER, RECEIVER) == v
    got_state, _, got_card = reg.load_state(v)
    assert got_card == card and all(torch.equal(got_state[k], state[k]) for k in state)
    # the signature is checked, not kept: the version folder holds the three files
    assert sorted(p.name for p in reg.path(v).iterdir()) == sorted(ARCHIVE_MEMBERS)
    assert reg.import_(archive, trust=trust, allow_unsigned=True) == v  # a no-op, still verified
    # Ed25519 is deterministic: the imported version re-signed is the same archive
    assert reg.export(v, tmp_path / "re.tar", exporter, EXPORTER).read_bytes() == archive.read_bytes()
    assert reg.export(v, tmp_path / "plain.tar").read_bytes() != archive.read_bytes()
    assert list(members(tmp_path / "plain.tar")) == list(ARCHIVE_MEMBERS)


def test_export_refuses_a_bad_signer_name(tmp_path, kv, exporter):
    archive, _, _ = exported(tmp_path, kv)
    src, v = FuserRegistry(tmp_path / "remote-a.tar"), version()
    with pytest.raises(IdentityError, match="bad identity name"):
        src.export(v, tmp_path / "x.tar", exporter, "../evil")
    with pytest.raises(ValueError, match="needs a signer"):
        src.export(v, tmp_path / "x.tar", None, EXPORTER)
    assert not (tmp_path / "x.tar").exists()
    default = src.export(v, tmp_path / "d.tar", exporter)
    assert json.loads(members(default)[SIGNATURE])["signer"] == "exporter"


def test_a_signed_archive_needs_a_trust_store(tmp_path, kv, exporter):
    archive, _, _ = signed(tmp_path, kv, exporter)
    for allow in (False, True):  # allow_unsigned never turns a signed archive into an unchecked one
        refused(tmp_path, archive, "signed by 'gpu-box' but no trust store was given",
                allow_unsigned=allow)


def test_an_unsigned_archive_is_refused_unless_allowed(tmp_path, kv, exporter, trust):
    archive, _, _ = exported(tmp_path, kv)
    msg = refused(tmp_path, archive, "the archive is not signed", allow_unsigned=False, trust=trust)
    assert msg.startswith("a.tar: ") and "allow_unsigned" in msg
    refused(tmp_path, archive, "the archive is not signed", allow_unsigned=False)
    # a signed archive stripped of its signature is just as unsigned
    stripped = build(tmp_path / "stripped.tar",
                     [(n, members(signed(tmp_path, kv, exporter)[0])[n]) for n in ARCHIVE_MEMBERS])
    refused(tmp_path, stripped, "not signed", allow_unsigned=False, trust=trust)
    assert FuserRegistry(tmp_path / "ok").import_(archive, allow_unsigned=True) == version()


def test_a_forged_archive_under_the_genuine_signature_is_refused(tmp_path, kv, exporter, trust):
    archive, state, _ = signed(tmp_path, kv, exporter)
    sig = (SIGNATURE, members(archive)[SIGNATURE])
    # new weights, the card's digests and sizes recomputed: every content check passes ...
    forged_state = {k: v + 0.5 if i == 0 else v for i, (k, v) in enumerate(sorted(state.items()))}
    forged = recarded(tmp_path, archive, forged_state, "forged.tar", extra=[sig])
    ok = FuserRegistry(tmp_path / "unchecked")
    unsigned = recarded(tmp_path, archive, forged_state, "forged-unsigned.tar")
    assert ok.import_(unsigned, allow_unsigned=True) == version()  # ... as the digests allow
    # ... but the signature covers the weights
    msg = refused(tmp_path, forged, "bad signature by 'gpu-box'", trust=trust, allow_unsigned=False)
    assert msg.startswith("forged.tar: ") and "altered after signing" in msg
    # the card alone edited (a better score, still self-consistent)
    m = members(archive)
    card = json.loads(m["card.json"])
    card["scores"]["val_loss"] = 0.1
    better = build(tmp_path / "card.tar", [("card.json", json.dumps(card).encode()),
                                          ("config.json", m["config.json"]),
                                          ("fuser.safetensors", m["fuser.safetensors"]), sig])
    refused(tmp_path, better, "bad signature", trust=trust, allow_unsigned=False)
    # the config re-serialised: the same config hash, other bytes
    compact = json.dumps(json.loads(m["config.json"]), separators=(",", ":")).encode()
    assert compact != m["config.json"]
    recfg = build(tmp_path / "cfg.tar", [("card.json", m["card.json"]), ("config.json", compact),
                                         ("fuser.safetensors", m["fuser.safetensors"]), sig])
    refused(tmp_path, recfg, "bad signature", trust=trust, allow_unsigned=False)


def test_an_archive_re_signed_by_another_key_is_refused(tmp_path, kv, exporter, trust):
    archive, state, _ = signed(tmp_path, kv, exporter)
    attacker = Identity.generate()
    forged = recarded(tmp_path, archive, {k: -v for k, v in state.items()}, "f.tar")
    # the pinned name, the attacker's key
    msg = refused(tmp_path, resign(tmp_path, forged, attacker, EXPORTER, "same-name.tar"),
                  "signed by 'gpu-box' with key .* but .* is pinned for 'gpu-box'",
                  trust=trust, allow_unsigned=False)
    assert fingerprint(attacker.public_bytes()) in msg and fingerprint(exporter.public_bytes()) in msg
    # a name nobody pinned (the attacker's own, or a genuine key under another name)
    refused(tmp_path, resign(tmp_path, forged, attacker, "mallory", "other-name.tar"),
            "signed by 'mallory', which has no key pinned", trust=trust, allow_unsigned=False)
    refused(tmp_path, resign(tmp_path, archive, exporter, "gpu-box-2", "renamed.tar"),
            "signed by 'gpu-box-2', which has no key pinned", trust=trust, allow_unsigned=False)
    # the genuine signature with its name changed to another pinned name of the same key
    two = TrustStore({EXPORTER: exporter.public_bytes(), "gpu-box-2": exporter.public_bytes()})
    m = members(archive)
    doc = dict(json.loads(m[SIGNATURE]), signer="gpu-box-2")
    renamed = build(tmp_path / "n.tar", [*((n, m[n]) for n in ARCHIVE_MEMBERS),
                                        (SIGNATURE, json.dumps(doc).encode())])
    refused(tmp_path, renamed, "bad signature by 'gpu-box-2'", trust=two, allow_unsigned=False)
    assert FuserRegistry(tmp_path / "ok").import_(archive, trust=two) == version()


def test_a_signature_swapped_between_genuine_archives_is_refused(tmp_path, kv, exporter, trust):
    first, _, _ = signed(tmp_path, kv, exporter, seed=0, name="first.tar")
    other, _, _ = signed(tmp_path, kv, exporter, seed=1, name="other.tar")  # same version id
    a, b = members(first), members(other)
    assert a[SIGNATURE] != b[SIGNATURE]
    swapped = build(tmp_path / "swapped.tar", [*((n, a[n]) for n in ARCHIVE_MEMBERS),
                                               (SIGNATURE, b[SIGNATURE])])
    refused(tmp_path, swapped, "bad signature by 'gpu-box'", trust=trust, allow_unsigned=False)
    # each genuine archive on its own imports
    for archive in (first, other):
        assert FuserRegistry(tmp_path / archive.stem).import_(archive, trust=trust) == version()


def _sig_doc(**edit):
    doc = {"format": 1, "signer": EXPORTER, "public_key": "ab" * 32, "signature": "cd" * 64}
    doc.update(edit)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize("data,match", [
    (b"not json", "signature.json is not strict UTF-8 JSON"),
    (b'{"format": NaN}', "signature.json is not strict UTF-8 JSON"),
    (b"\xff\xfe", "signature.json is not strict UTF-8 JSON"),
    (b"[1, 2]", "must be an object with exactly the keys"),
    (_sig_doc(extra=1), "must be an object with exactly the keys"),
    (_sig_doc(signature=...), "must be an object with exactly the keys"),
    (_sig_doc(format=2), "has format '2'; this edgefuse reads format 1"),
    (_sig_doc(format=True), "has format 'True'"),
    (_sig_doc(format="1"), "has format '1'"),
    (_sig_doc(signer="../up"), "bad identity name"),
    (_sig_doc(signer=7), "bad identity name"),
    (_sig_doc(public_key="ab" * 31), "public_key must be 64 lowercase hex"),
    (_sig_doc(public_key="AB" * 32), "public_key must be 64 lowercase hex"),
    (_sig_doc(public_key="zz" * 32), "public_key must be 64 lowercase hex"),
    (_sig_doc(signature="cd" * 63), "signature must be 128 lowercase hex"),
    (_sig_doc(signature=12), "signature must be 128 lowercase hex"),
])
def test_a_malformed_signature_file_is_refused(tmp_path, kv, exporter, trust, data, match):
    archive, _, _ = signed(tmp_path, kv, exporter)
    m = members(archive)
    bad = build(tmp_path / "m.tar", [*((n, m[n]) for n in ARCHIVE_MEMBERS), (SIGNATURE, data)])
    msg = refused(tmp_path, bad, match, trust=trust, allow_unsigned=True)
    assert msg.startswith("m.tar: ")


def test_an_oversized_or_duplicate_signature_is_refused_before_reading(tmp_path, kv, exporter, trust):
    archive, _, _ = signed(tmp_path, kv, exporter)
    m = members(archive)
    # a header declaring 1 MiB of signature and no data behind it
    info = tarfile.TarInfo(SIGNATURE)
    info.size = 2 ** 20
    bomb = tmp_path / "bomb.tar"
    bomb.write_bytes(info.tobuf(tarfile.USTAR_FORMAT) + bytes(1024))
    refused(tmp_path, bomb, r"'signature.json' declares 1048576 bytes, more than the 4096 allowed; "
                            "refused before reading", trust=trust)
    # a real one padded past the cap (still valid JSON)
    fat = build(tmp_path / "fat.tar", [*((n, m[n]) for n in ARCHIVE_MEMBERS),
                                       (SIGNATURE, m[SIGNATURE] + b" " * 4096)])
    refused(tmp_path, fat, "'signature.json' declares 4", trust=trust)
    twice = build(tmp_path / "twice.tar", [*m.items(), (SIGNATURE, m[SIGNATURE])])
    refused(tmp_path, twice, "'signature.json' appears twice", trust=trust)
