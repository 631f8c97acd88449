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
    assert main(["fusers", "import", "--registry", str(run), str(out)]) == 0
    line = capsys.readouterr().out
    assert f"fuser {v.id} (tiny-llama -> tiny-qwen2): imported" in line
    got, _, got_card = FuserRegistry(run).load_state(v)
    assert got_card == card and all(torch.equal(got[k], state[k]) for k in state)
    assert main(["fusers", "import", "--registry", str(run), str(out)]) == 0
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
                          str(tmp_path / "run"), str(bad)], capture_output=True, text=True, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("edgefuse: error: bad.tar: the card says ")
    assert tree(tmp_path / "run") == []
    with tarfile.open(bad) as tar:
        assert [x.name for x in tar.getmembers()] == ["card.json", "config.json", "fuser.safetensors"]
