"""The ``edgefuse run`` launcher (edgefuse.cli.launch) with its subprocess calls faked: the
overrides it pins, the exact ``flwr run`` command, run config and environment it builds, the
foreign-SuperLink warning, and how ``data.mirror`` resolves (null / hub / unset)."""

import json
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from edgefuse import data
from edgefuse.cli import launch
from edgefuse.cli.main import main
from edgefuse.config import compose

VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """A checkout at tmp/checkout with a data mirror beside it (tmp/shared/data/dolly, four
    GSM8K test rows) and
    no EDGEFUSE_* variables: the default resolution finds that mirror."""
    mirror = tmp_path / "shared" / "data"
    (mirror / "dolly").mkdir(parents=True)
    (mirror / "gsm8k").mkdir()  # compose counts the GSM8K test rows against c2c.eval.gsm8k_n
    (mirror / "gsm8k" / "test.jsonl").write_text(
        "".join(f'{{"question": "What is {i} + 1?", "answer": "{i} + 1 = {i + 1}\\n#### {i + 1}"}}\n' for i in range(4)))
    monkeypatch.setattr(data, "PROJECT_ROOT", tmp_path / "checkout")
    for var in ("EDGEFUSE_DATA_MIRROR", "EDGEFUSE_CACHE", "EDGEFUSE_OUTPUTS"):
        monkeypatch.delenv(var, raising=False)
    return mirror


def test_pinned_overrides_are_explicit_and_absolute(tmp_path, beside):
    cfg = compose("tiny", f"paths.cache_dir={tmp_path}/c")
    assert launch.pinned_overrides(cfg, ["experiment=tiny", "training.lr=1e-3", f"paths.cache_dir={tmp_path}/c"]) == [
        "experiment=tiny", "training.lr=1e-3",  # the job's own cache override gives way to the pinned one
        f"paths.cache_dir='{tmp_path}/c'", f"data.mirror='{beside}'"]
    hub = compose("tiny", "data.mirror=hub")
    assert launch.pinned_overrides(hub, [])[-1] == "data.mirror=hub"
    quoted = launch.pinned_overrides(compose("tiny", ["paths.cache_dir='/tmp/it\\'s here'"]), [])
    assert quoted[0] == "paths.cache_dir='/tmp/it\\'s here'"
    assert compose("tiny", quoted).paths.cache_dir == "/tmp/it's here"
    # what is pinned composes back to the same paths (the ServerApp's side)
    again = compose("tiny", launch.pinned_overrides(cfg, []))
    assert (again.paths.cache_dir, again.data.mirror) == (f"{tmp_path}/c", str(beside))


@pytest.mark.parametrize("override, expected", [
    ([], "beside"), (["data.mirror=null"], None), (["data.mirror=hub"], None),
    (["data.mirror=~"], None), (["data.mirror=HUB_DIR"], "dir")])
def test_data_mirror_resolution(tmp_path, beside, override, expected):
    """Unset: the mirror beside the checkout; an explicit null (or ``~``) or ``hub``: the hub."""
    other = tmp_path / "elsewhere"
    items = [o.replace("HUB_DIR", str(other)) for o in override]
    want = {"beside": str(beside), "dir": str(other), None: None}[expected]
    assert compose("tiny", items).data.mirror == want


def test_data_mirror_null_means_the_hub_even_with_the_environment_set(tmp_path, beside, monkeypatch):
    monkeypatch.setenv("EDGEFUSE_DATA_MIRROR", str(tmp_path / "env"))
    assert compose("tiny").data.mirror == str(tmp_path / "env")
    assert compose("tiny", "data.mirror=null").data.mirror is None


class FakePopen:
    """Records ``flwr run``'s command and environment, prints a Flower-like log and writes
    the results.json a finished run leaves (``status``)."""

    calls: list = []
    status = "completed"
    returncode = 0

    def __init__(self, cmd, env=None, **kw):
        FakePopen.calls.append({"cmd": cmd, "env": env, **kw})
        config = tomllib.loads(Path(cmd[cmd.index("--run-config") + 1]).read_text())
        out = Path(config["output-dir"])
        if self.status is not None:
            (out / "results.json").write_text(json.dumps(
                {"config": {}, "rounds": [], "status": self.status, "error": "boom"}))
        self.stdout = iter(["INFO : starting\n", "Successfully started run 4242\n"])

    def wait(self):
        return self.returncode


@pytest.fixture
def fake_flwr(monkeypatch, tmp_path):
    flwr = tmp_path / "bin" / "flwr"
    flwr.parent.mkdir()
    flwr.write_text("")
    monkeypatch.setattr(launch.shutil, "which", lambda name: str(flwr) if name == "flwr" else None)
    FakePopen.calls, FakePopen.status, FakePopen.returncode = [], "completed", 0
    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    return flwr


def test_run_flower_builds_the_exact_flwr_command_and_run_config(tmp_path, fake_flwr, beside, capsys):
    cfg = compose("tiny", "federation.client_num_cpus=3")
    overrides = ["experiment=tiny", "training.lr=1e-3", "paths.cache_dir='/c d'", "data.mirror=hub"]
    out = tmp_path / "run"
    res = launch.run_flower(cfg, overrides, out)
    assert res["status"] == "completed"
    (call,) = FakePopen.calls
    run_config = out / "run_config.toml"
    assert call["cmd"] == [str(fake_flwr), "run", str(launch.APP_DIR), "local", "--stream",
                           "--federation-config", "num-supernodes=4 client-resources-num-cpus=3",
                           "--run-config", str(run_config)]
    assert launch.APP_DIR == Path(__file__).resolve().parents[2]  # the folder with pyproject.toml
    assert (launch.APP_DIR / "pyproject.toml").is_file()
    rc = tomllib.loads(run_config.read_text())
    assert rc == {"experiment": "tiny", "overrides": shlex.join(overrides), "output-dir": str(out)}
    assert shlex.split(rc["overrides"]) == overrides
    env = call["env"]
    for k, v in launch.FLOWER_ENV.items():
        assert env[k] == v
    assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    assert env["PATH"].split(":")[0] == str(fake_flwr.parent)  # flwr starts this env's SuperLink
    assert "[edgefuse] " + shlex.join(call["cmd"]) in capsys.readouterr().out


@pytest.mark.parametrize("status, returncode, message", [
    ("failed", 0, "the run failed: boom"), (None, 1, "`flwr run` exited with 1 and wrote no"),
    ("completed", 3, "`flwr run` exited with 3")])
def test_run_flower_failures(tmp_path, fake_flwr, beside, status, returncode, message):
    FakePopen.status, FakePopen.returncode = status, returncode
    with pytest.raises(launch.RunFailed, match=message.replace("(", r"\(")):
        launch.run_flower(compose("tiny"), [], tmp_path / "run")


def proc(cmdline, pythonpath=None):
    env = {} if pythonpath is None else {"PYTHONPATH": pythonpath}
    return type("P", (), {"info": {"cmdline": cmdline}, "environ": lambda self: env})()


@pytest.mark.parametrize("cmdline, foreign", [
    (["/other/venv/bin/python", "/other/venv/bin/flower-superlink", "--simulation"], True),
    ([str(VENV_BIN / "python"), str(VENV_BIN / "flower-superlink"), "--simulation"], False),
    ([str(VENV_BIN) + "2/python", str(VENV_BIN) + "2/flower-superlink", "--simulation"], True),
    (["/other/venv/bin/python", "/other/venv/bin/flower-superlink", "--insecure"], False),  # not simulation
    (["/usr/bin/python3", "-m", "http.server"], False),
])
def test_foreign_superlink(monkeypatch, cmdline, foreign):
    import psutil

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter([proc(None), proc(cmdline)]))
    assert launch.foreign_superlink() == (" ".join(cmdline[:2]) if foreign else None)


def test_superlink_of_this_environment_with_another_pythonpath_is_foreign(monkeypatch):
    """A SuperLink started with PYTHONPATH=<another checkout> imports that checkout's code."""
    import psutil

    cmdline = [str(VENV_BIN / "python"), str(VENV_BIN / "flower-superlink"), "--simulation"]
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter([proc(cmdline, "/tmp/wt")]))
    assert launch.foreign_superlink() == " ".join(cmdline[:2]) + " with PYTHONPATH=/tmp/wt"
    monkeypatch.setenv("PYTHONPATH", "/tmp/wt")  # the same PYTHONPATH as ours: not foreign
    assert launch.foreign_superlink() is None


@pytest.fixture
def fake_run(monkeypatch):
    """``edgefuse run`` up to ``flwr``: what run_flower was given, nothing started."""
    seen = {}

    def run_flower(cfg, overrides, out):
        seen.update(cfg=cfg, overrides=overrides, out=out)
        return {}
    monkeypatch.setattr(launch, "run_flower", run_flower)
    monkeypatch.setattr(launch, "prefetch", lambda cfg: seen.setdefault("prefetched", True))
    monkeypatch.setattr(launch, "mirror_file", lambda data_cfg: None)
    monkeypatch.setattr(launch, "public_slices", lambda data_cfg, seed: None)
    monkeypatch.setattr(launch, "foreign_superlink", lambda: seen.get("foreign"))
    monkeypatch.setattr(sys, "argv", ["edgefuse"])
    return seen


def test_edgefuse_run_pins_cache_and_mirror(tmp_path, beside, fake_run, capsys):
    cache = tmp_path / "cache"
    assert main(["run", "experiment=tiny", f"outputs.root={tmp_path}/out", f"paths.cache_dir={cache}",
                 "training.lr=1e-3"]) == 0
    assert fake_run["overrides"] == ["experiment=tiny", f"outputs.root={tmp_path}/out", "training.lr=1e-3",
                                     f"paths.cache_dir='{cache}'", f"data.mirror='{beside}'"]
    assert fake_run["out"].parent == tmp_path / "out" and fake_run["out"].name.endswith("-tiny")
    assert fake_run["prefetched"] is True
    assert "warning" not in capsys.readouterr().err


def test_edgefuse_run_with_data_mirror_null_pins_the_hub(tmp_path, beside, fake_run):
    assert main(["run", "experiment=tiny", f"outputs.root={tmp_path}/out", "data.mirror=null"]) == 0
    assert fake_run["overrides"][-1] == "data.mirror=hub" and fake_run["cfg"].data.mirror is None
    assert not any(o == "data.mirror=null" for o in fake_run["overrides"])


def test_edgefuse_run_warns_about_a_foreign_superlink(tmp_path, beside, fake_run, capsys):
    fake_run["foreign"] = "/other/venv/bin/python /other/venv/bin/flower-superlink"
    assert main(["run", "experiment=tiny", f"outputs.root={tmp_path}/out"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["[edgefuse] warning: the running local SuperLink (/other/venv/bin/python "
                   "/other/venv/bin/flower-superlink) belongs to another Python environment and runs "
                   "that environment's edgefuse code; stop it (`pkill -f flower-superlink`) to use this one."]
    assert "overrides" in fake_run  # a warning, not a refusal
