"""``edgefuse fusers export`` / ``edgefuse fusers import``: the round trip, and every bad input
as one line on stderr with exit status 2 (nothing written into the registry)."""

import json
import subprocess
import sys
import tarfile

import pytest
import torch

from edgefuse.c2c.registry import FuserRegistry
from edgefuse.cli.main import main
from tests.c2c.test_registry_io import build, exported, members, tree, version


@pytest.fixture(scope="module")
def kv():
    from edgefuse.c2c.fuser import kv_spec_from_config
    from edgefuse.models import model_config

    return {s: kv_spec_from_config(model_config(s)) for s in ("tiny-llama", "tiny-qwen2")}


def err_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_then_import(tmp_path, kv, capsys):
    archive, state, card = exported(tmp_path, kv)  # the remote registry is tmp_path/remote-a.tar
    v = version()
    out = tmp_path / "cli.tar"
    assert main(["fusers", "export", "--registry", str(tmp_path / "remote-a.tar"), "--version", v.id,
                 "--out", str(out)]) == 0
    assert f"exported fuser {v.id} to {out}" in capsys.readouterr().out
    assert out.read_bytes() == archive.read_bytes()

    run = tmp_path / "run"
    assert main(["fusers", "import", "--registry", str(run), "--allow-unsigned", str(out)]) == 0
    line = capsys.readouterr().out
    assert f"fuser {v.id} (tiny-llama -> tiny-qwen2): imported" in line
    got, _, got_card = FuserRegistry(run).load_state(v)
    assert got_card == card and all(torch.equal(got[k], state[k]) for k in state)
    assert main(["fusers", "import", "--registry", str(run), "--allow-unsigned", str(out)]) == 0
    assert "already in the registry, nothing written" in capsys.readouterr().out
    assert main(["fusers", "list", str(run)]) == 0
    assert v.id in capsys.readouterr().out


def run_cli(*args) -> int:
    try:
        return main(["fusers", *args])
    except SystemExit as e:  # argparse usage errors
        return e.code


def test_bad_input_is_one_line_and_status_2(tmp_path, kv, capsys):
    archive, _, _ = exported(tmp_path, kv)
    remote, run, v = str(tmp_path / "remote-a.tar"), str(tmp_path / "run"), version()
    evil = build(tmp_path / "evil.tar", [("../x", b"1"), *members(archive).items()])
    cases = [
        (["export", "--registry", str(tmp_path / "none"), "--version", v.id, "--out", "x.tar"],
         "no registry folder"),
        (["export", "--registry", remote, "--version", "zz", "--out", "x.tar"],
         "'zz' is not a fuser version id"),
        (["export", "--registry", remote, "--version", "0" * 16, "--out", "x.tar"],
         f"no fuser version {'0' * 16}"),
        (["export", "--registry", remote, "--version", v.id, "--out", f"{archive}/x.tar"],
         "File exists"),
        (["import", "--registry", run, str(tmp_path / "missing.tar")], "cannot read the fuser archive"),
        (["import", "--registry", run, str(evil)], "absolute or parent path"),
        (["import", "--registry", run, str(archive)], "the archive is not signed"),
        (["import", "--registry", run, "--trust", str(tmp_path / "none.json"), str(archive)],
         "no trust file"),
        (["import", "--registry", run], "the following arguments are required: archive"),
        (["export", "--registry", remote, "--version", v.id], "the following arguments are required: --out"),
    ]
    for args, want in cases:
        rc = run_cli(*args)
        line = err_line(capsys)
        assert rc == 2 and want in line, (args, rc, line)
    assert tree(tmp_path / "run") == [] and not (tmp_path / "x").exists()


def test_a_tampered_archive_from_the_shell(tmp_path, kv):
    """As a subprocess: the refusal is one line on stderr, exit 2, no traceback."""
    archive, _, _ = exported(tmp_path, kv)
    m = members(archive)
    c = json.loads(m["card.json"])
    c["params"] += 1
    bad = build(tmp_path / "bad.tar", [("card.json", json.dumps(c).encode()),
                                       ("config.json", m["config.json"]),
                                       ("fuser.safetensors", m["fuser.safetensors"])])
    res = subprocess.run([sys.executable, "-m", "edgefuse.cli", "fusers", "import", "--registry",
                          str(tmp_path / "run"), "--allow-unsigned", str(bad)], capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("edgefuse: error: bad.tar: the card says ")
    assert tree(tmp_path / "run") == []
    with tarfile.open(bad) as tar:
        assert [x.name for x in tar.getmembers()] == ["card.json", "config.json", "fuser.safetensors"]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "edgefuse.cli", "fusers", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_signed_export_pin_and_import_from_the_shell(tmp_path, kv):
    """The exporter signs, the importer pins the printed key and imports; an unsigned archive
    without --allow-unsigned is one stderr line and exit 2, with nothing written."""
    from edgefuse.transport.identity import Identity, fingerprint

    archive, state, card = exported(tmp_path, kv)
    v, key = version(), tmp_path / "exporter" / "identity.key"
    ident = Identity.generate()
    ident.save(key)
    public = ident.public_bytes().hex()
    res = cli("export", "--registry", str(tmp_path / "remote-a.tar"), "--version", v.id,
              "--out", str(tmp_path / "signed.tar"), "--sign-key", str(key), "--signer", "gpu-box")
    assert res.returncode == 0, res.stderr
    assert f"signed as gpu-box: public key {public}  fingerprint {ident.fingerprint}" in res.stdout
    assert f"edgefuse fusers trust --trust FILE gpu-box {public}" in res.stdout
    assert list(members(tmp_path / "signed.tar")) == ["card.json", "config.json", "fuser.safetensors",
                                                      "signature.json"]

    trust = tmp_path / "importer" / "trust.json"
    res = cli("trust", "--trust", str(trust), "gpu-box", public)
    assert res.returncode == 0, res.stderr
    assert f"gpu-box      {fingerprint(ident.public_bytes())}  pinned in {trust}" in res.stdout
    assert json.loads(trust.read_text()) == {"version": 1, "pins": {"gpu-box": public}}

    run = tmp_path / "run"
    res = cli("import", "--registry", str(run), "--trust", str(trust), str(tmp_path / "signed.tar"))
    assert res.returncode == 0, res.stderr
    assert f"fuser {v.id} (tiny-llama -> tiny-qwen2): imported" in res.stdout
    reg = FuserRegistry(run)
    assert reg.latest("tiny-llama", "tiny-qwen2") == v
    got, _, got_card = reg.load_state(v)
    assert got_card == card and all(torch.equal(got[k], state[k]) for k in state)

    res = cli("import", "--registry", str(tmp_path / "run2"), "--trust", str(trust), str(archive))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("edgefuse: error: a.tar: the archive is not signed")
    assert tree(tmp_path / "run2") == [] and res.stdout == ""


def test_signing_and_pinning_errors_are_one_line(tmp_path, kv, capsys):
    from edgefuse.transport.identity import Identity

    archive, _, _ = exported(tmp_path, kv)
    remote, v = str(tmp_path / "remote-a.tar"), version()
    key, other = tmp_path / "k" / "identity.key", Identity.generate()
    Identity.generate().save(key)
    loose = tmp_path / "loose.key"
    other.save(loose)
    loose.chmod(0o644)
    trust = tmp_path / "trust.json"
    assert main(["fusers", "trust", "--trust", str(trust), "gpu-box", "ab" * 32]) == 0
    assert "pinned in" in capsys.readouterr().out
    assert main(["fusers", "trust", "--trust", str(trust), "gpu-box", "ab" * 32]) == 0
    assert "already pinned in" in capsys.readouterr().out
    bad_trust = tmp_path / "bad.json"
    bad_trust.write_text("{")
    cases = [
        (["trust", "--trust", str(trust), "gpu-box", "cd" * 32], "'gpu-box' is already pinned to"),
        (["trust", "--trust", str(trust), "gpu-box", "xyz"], "64 hex characters"),
        (["trust", "--trust", str(trust), "gpu-box", "ab" * 31], "an Ed25519 public key is 32 bytes"),
        (["trust", "--trust", str(trust), "../x", "ab" * 32], "bad identity name"),
        (["export", "--registry", remote, "--version", v.id, "--out", str(tmp_path / "x.tar"),
          "--signer", "gpu-box"], "--signer needs --sign-key"),
        (["export", "--registry", remote, "--version", v.id, "--out", str(tmp_path / "x.tar"),
          "--sign-key", str(tmp_path / "none.key")], "no identity key at"),
        (["export", "--registry", remote, "--version", v.id, "--out", str(tmp_path / "x.tar"),
          "--sign-key", str(loose)], "is readable by others"),
        (["export", "--registry", remote, "--version", v.id, "--out", str(tmp_path / "x.tar"),
          "--sign-key", str(key), "--signer", "a b"], "bad identity name"),
        (["import", "--registry", str(tmp_path / "run"), "--trust", str(bad_trust), str(archive)],
         "is malformed"),
    ]
    for args, want in cases:
        rc = run_cli(*args)
        line = err_line(capsys)
        assert rc == 2 and want in line, (args, rc, line)
    assert not (tmp_path / "x.tar").exists() and tree(tmp_path / "run") == []
    assert json.loads(trust.read_text())["pins"] == {"gpu-box": "ab" * 32}
    assert main(["fusers", "trust", "--trust", str(trust), "--replace", "gpu-box", "cd" * 32]) == 0
    assert json.loads(trust.read_text())["pins"] == {"gpu-box": "cd" * 32}
