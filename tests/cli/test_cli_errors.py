"""Every CLI failure is one line on stderr and a non-zero exit status, never a traceback
(``python -m edgefuse.cli ...`` as a subprocess)."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def cli(*args, env=None, cwd=None):
    full = {**os.environ, **(env or {})}
    res = subprocess.run([sys.executable, "-m", "edgefuse.cli", *args], capture_output=True, text=True,
                         env=full, cwd=cwd, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert len(lines) == 1, res.stderr
    return res.returncode, lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unknown_model_name():
    rc, line = cli("models", "fetch", "no-such-model")
    assert rc == 2 and line.startswith("edgefuse: error: unknown model 'no-such-model': use one of ")
    rc, line = cli("cloud", "generate", "--model", "no-such-model", "--mode", "edge", "--prompt", "hi")
    assert rc == 2 and line.startswith("edgefuse: error: unknown model 'no-such-model'")


def test_bad_overrides_and_arguments():
    rc, line = cli("run", "training.no_such_key=1")
    assert rc == 2 and line.startswith("edgefuse: error: could not compose the config")
    assert "training.no_such_key" in line
    rc, line = cli("run", "training.lr==")
    assert rc == 2 and line.startswith("edgefuse: error: bad override 'training.lr=='")
    rc, line = cli("run", "--multirun", "training.lr=-1,1e-4")  # a sweep: its first value is checked
    assert rc == 2 and line == "edgefuse: error: training.lr must be a finite number > 0, got -1"
    # values that fail only inside a client are refused before Flower starts, naming the key
    for override, want in [("training.lr=nan", "training.lr must be a finite number > 0, got nan"),
                           ("seed=abc", "seed must be an integer >= 0, got 'abc'"),
                           ("data.partitioning=bogus", "unknown data.partitioning='bogus'; "
                                                       "valid: ['category', 'dirichlet']"),
                           ("data.dirichlet_alpha=0", "data.dirichlet_alpha must be a finite number > 0"),
                           ("data.max_train_examples=0", "data.max_train_examples must be null")]:
        rc, line = cli("run", "experiment=tiny", override)
        assert rc == 2 and line.startswith("edgefuse: error: " + want), (override, line)
    # an unknown client model is named as such, not as a c2c pair it no longer matches
    rc, line = cli("run", "federation.clients.0.model=bogus")
    assert rc == 2 and line.startswith("edgefuse: error: unknown model 'bogus': use one of "), line
    rc, line = cli("cloud", "generate", "--no-such-flag")
    assert rc == 2 and line == ("edgefuse cloud: error: unrecognized arguments: --no-such-flag "
                                "(see edgefuse cloud --help)")
    for flag, value in [("--max-new-tokens", "1000000000"), ("--max-new-tokens", "0"), ("--gamma", "-1"),
                        ("--port", "70000"), ("--threads", "0")]:
        rc, line = cli("cloud", "generate", flag, value, "--prompt", "hi")  # refused before any load
        assert rc == 2 and line.startswith(f"edgefuse cloud generate: error: argument {flag}: "), line
    rc, line = cli("frobnicate")
    assert rc == 2 and line.startswith("edgefuse: error: unknown command 'frobnicate'")


def test_missing_mirror(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    rc, line = cli("cloud", "generate", "--model", "tiny-qwen2", "--mode", "edge", "--prompt", "hi",
                   "--draft-head", "64", env={"EDGEFUSE_DATA_MIRROR": nowhere})
    assert rc == 2 and line.startswith("edgefuse: error: dolly mirror file not found: " + nowhere)
    assert "data.mirror" in line and "EDGEFUSE_DATA_MIRROR" in line
    out = tmp_path / "out"
    rc, line = cli("run", "experiment=tiny", f"data.mirror={nowhere}", f"outputs.root={out}")
    # the first file compose needs from the mirror is named (GSM8K: c2c.eval.gsm8k_n is checked there)
    assert rc == 2 and line.startswith("edgefuse: error: ") and "mirror file not found: " + nowhere in line
    assert not any(out.glob("*/*"))  # nothing ran: no job folder left behind


def test_a_failed_launch_never_deletes_a_folder_it_did_not_make(tmp_path):
    """The attack: ``hydra.run.dir`` pointed at a folder holding a user's files (or a
    checkpoint a restart resumes from) and a launch that fails before running. The folder
    and everything in it stay; only a folder with nothing but Hydra's record goes."""
    precious = tmp_path / "precious"
    (precious / ".git").mkdir(parents=True)
    (precious / "notes.txt").write_text("mine")
    (precious / "checkpoint").mkdir()
    (precious / "checkpoint" / "ckpt-r001.bin").write_bytes(b"x")
    rc, line = cli("run", "experiment=tiny", f"hydra.run.dir={precious}", f"data.mirror={tmp_path / 'nowhere'}")
    assert rc == 2 and "mirror file not found" in line
    assert (precious / "notes.txt").read_text() == "mine" and (precious / ".git").is_dir()
    assert (precious / "checkpoint" / "ckpt-r001.bin").is_file()
    fresh = tmp_path / "fresh"
    rc, _ = cli("run", "experiment=tiny", f"hydra.run.dir={fresh}", f"data.mirror={tmp_path / 'nowhere'}")
    assert rc == 2 and not fresh.exists()


def test_unreachable_hub():
    offline = {"EDGEFUSE_DATA_MIRROR": "hub", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    rc, line = cli("cloud", "generate", "--model", "tiny-qwen2", "--mode", "edge", "--prompt", "hi",
                   "--draft-head", "64", env=offline)
    assert rc == 2
    assert line.startswith("edgefuse: error: could not load 'databricks/databricks-dolly-15k' from the hub")
    assert "EDGEFUSE_DATA_MIRROR" in line


def test_unreachable_cloud():
    port = str(free_port())
    rc, line = cli("cloud", "health", "--port", port, "--timeout", "2")
    assert rc == 1 and line.startswith(f"edgefuse: error: no health answer from the cloud at 127.0.0.1:{port}")
    rc, line = cli("cloud", "generate", "--model", "tiny-qwen2", "--mode", "cloud", "--prompt", "hi",
                   "--port", port)
    assert rc == 1 and line.startswith(f"edgefuse: error: no cloud service at 127.0.0.1:{port}")


def test_draft_head_finds_the_mirror_beside_the_checkout(tmp_path):
    """Without EDGEFUSE_DATA_MIRROR, `cloud generate --draft-head` uses ../shared/data (as
    `edgefuse run` does) instead of trying the hub."""
    if not (ROOT.parent / "shared" / "data" / "dolly").is_dir():
        pytest.skip("needs the data mirror at ../shared/data beside the checkout")
    env = {k: v for k, v in os.environ.items() if k != "EDGEFUSE_DATA_MIRROR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", EDGEFUSE_CACHE=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "edgefuse.cli", "cloud", "generate", "--model", "tiny-qwen2",
                          "--mode", "edge", "--prompt", "hi", "--draft-head", "64", "--max-new-tokens", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert list((tmp_path / "draft_heads").glob("*-64.json"))  # the head was built from the corpus


def test_a_bad_trust_store_is_refused_before_any_model_loads(tmp_path):
    """A corrupt trust.json fails in one line before the edge model is loaded: the cache is
    empty and offline, so a load first would fail on the model instead."""
    from edgefuse.transport.identity import device_dir, provision

    provision(tmp_path / "keys", 1)
    home = device_dir(tmp_path / "keys", 0)
    (home / "trust.json").write_text("{not json")
    rc, line = cli("cloud", "generate", "--model", "qwen2.5-coder-0.5b", "--mode", "cloud", "--prompt", "hi",
                   "--device-dir", str(home), "--cache-dir", str(tmp_path / "empty-cache"),
                   env={"HF_HUB_OFFLINE": "1"})
    assert rc == 2 and line.startswith(f"edgefuse: error: trust store {home / 'trust.json'} is malformed"), line
    assert not (tmp_path / "empty-cache").exists()
