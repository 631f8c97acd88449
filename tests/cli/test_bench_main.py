"""``make bench`` (bench/bench_main.py) refuses to overwrite a JSON that records another job
(experiments, label or overrides) unless ``--force`` or ``--append``; the runs are faked."""

import importlib.util
import json

import pytest

from tests.conftest import ROOT


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_main_under_test", ROOT / "bench" / "bench_main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ran = []

    def run_experiment(name, out_root, extra, repo, python, label, on_progress=None, env=None):
        mod.ran.append((label, name, list(extra)))
        return {"experiment": name, "label": label, "overrides": list(extra), "partial": False,
                "wall_s": 1.0, "startup_s": 0.5, "teardown_s": 0.1, "peak_pss_bytes": 2**30,
                "load1_mean": 1.0, "phase_seconds": {"train": 0.4}, "rates": {}}
    monkeypatch.setattr(mod, "run_experiment", run_experiment)
    monkeypatch.setattr(mod, "own_superlink_env", lambda home: {"FLWR_HOME": str(home)})
    monkeypatch.setattr(mod, "stop_own_superlink", lambda home: 0)
    monkeypatch.setattr(mod, "plot", lambda report, path: None)
    return mod


def committed(path, experiments=("default",), overrides=(), label=""):
    """A results JSON as an earlier bench left it."""
    path.write_text(json.dumps({"experiments": [
        {"experiment": e, "label": label, "overrides": list(overrides), "wall_s": 700.0}
        for e in experiments]}))
    return path.read_text()


def test_refuses_to_overwrite_another_job(bench, tmp_path, capsys):
    out = tmp_path / "bench_main.json"
    before = committed(out)
    assert bench.main(["--out", str(out), "--experiments", "smoke"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench_main: error: {out} holds another job (default (no overrides)), this one is "
                   "smoke (no overrides): pass --force to overwrite it, --append to add to it, or "
                   "--out for a new file"]
    assert out.read_text() == before and bench.ran == []  # nothing ran, nothing written
    assert bench.main(["--out", str(out), "training.lr=1e-3"]) == 2  # same experiment, other overrides
    assert "this one is default training.lr=1e-3" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--label", "after"]) == 2  # same experiment, other label
    assert out.read_text() == before and bench.ran == []


def test_same_job_force_and_append_may_write(bench, tmp_path):
    out = tmp_path / "bench_main.json"
    committed(out)
    assert bench.main(["--out", str(out)]) == 0  # the same job: measured again
    assert [e["experiment"] for e in json.loads(out.read_text())["experiments"]] == ["default"]
    assert bench.main(["--out", str(out), "--experiments", "smoke", "--force"]) == 0
    assert [e["experiment"] for e in json.loads(out.read_text())["experiments"]] == ["smoke"]
    assert bench.main(["--out", str(out), "--experiments", "default", "--append"]) == 0
    assert [e["experiment"] for e in json.loads(out.read_text())["experiments"]] == ["smoke", "default"]
    assert bench.ran == [("", "default", []), ("", "smoke", []), ("", "default", [])]
    assert bench.main(["--out", str(tmp_path / "new.json"), "--experiments", "full"]) == 0  # a new file


def test_older_files_are_read_from_their_commands(bench, tmp_path):
    """Entries written before ``overrides`` was recorded: the overrides are the words of the
    command after ``outputs.root=...``."""
    report = {"experiments": [{"experiment": "default", "command": "/v/python -m edgefuse.cli run "
                               "experiment=default outputs.root=/r/default training.lr=1e-3"}]}
    assert bench.recorded_jobs(report) == {("", "default", ("training.lr=1e-3",))}
    out = tmp_path / "old.json"
    out.write_text(json.dumps(report))
    assert bench.check_overwrite(out, {("", "default", ("training.lr=1e-3",))}, False, False) is None
    assert "holds another job" in bench.check_overwrite(out, {("", "default", ())}, False, False)
