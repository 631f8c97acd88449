"""Resuming a run: checkpoints round-trip the server state exactly; a truncated, altered or
forged checkpoint is ignored (the previous one is used); one of another config refuses the
run; a run killed in round 2 and started again on its folder ends as an uninterrupted run
does, without retraining round 1 or rerunning completed phases — on a fake Grid, and
(integration) through ``edgefuse run`` with the process group SIGKILLed after round 1.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest

from edgefuse.aggregation import ClientUpdate, aggregate_group
from edgefuse.app import checkpoint, phases
from edgefuse.app.checkpoint import Checkpoint, CheckpointError, CheckpointMismatch
from edgefuse.app.strategy import GroupedLoRA
from edgefuse.config import compose
from edgefuse.lora import pack_adapter, unpack_adapter
from edgefuse.results import JSON_NAME, RunRecorder
from edgefuse.results.recorder import redact_results, scrub_text
from tests.app.test_phases import CLIENTS, OFF, FakeGrid, recording, run_main
from tests.app.test_phases import server_identity  # noqa: F401  (autouse: Flower's ids)
from tests.app.test_strategy import KEY
from tests.conftest import ROOT, mirror_path

KEY_BYTES = bytes(range(32))


def lora(rank: int, seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"{KEY}.lora_A.weight": (scale * rng.normal(0, 0.1, (rank, 16))).astype(np.float32),
            f"{KEY}.lora_B.weight": (scale * rng.normal(0, 0.1, (16, rank))).astype(np.float32)}


@pytest.fixture
def cfg(tmp_path):
    return compose("tiny", [f"paths.cache_dir={tmp_path / 'cache'}"])


def tiny_checkpoint(cfg, round_idx: int = 1) -> Checkpoint:
    """Round ``round_idx`` of the tiny federation, aggregated by the real code: FlexLoRA for
    tiny-llama (ranks 4 and 8), FedAvg for tiny-qwen2 (one shared state)."""
    llama = aggregate_group([ClientUpdate(0, "tiny-llama", 4, 16.0, 8, lora(4, 0)),
                             ClientUpdate(1, "tiny-llama", 8, 16.0, 5, lora(8, 1))])
    qwen = aggregate_group([ClientUpdate(2, "tiny-qwen2", 4, 16.0, 8, lora(4, 2 + round_idx))])
    strategy = GroupedLoRA(cfg)
    strategy.groups = {"tiny-llama": llama, "tiny-qwen2": qwen}
    strategy.shapes = {"tiny-llama": {KEY: (16, 16)}, "tiny-qwen2": {KEY: (16, 16)}}
    rec = RunRecorder("/unused", cfg)
    for r in range(1, round_idx + 1):
        rec.add_round({"round": r, "clients": [{"partition_id": 0, "train_loss": 1.0 / r,
                                                "text": "private prompt"}]})
    audit = {"adapter": {"payloads": 3, "bytes": 120, "canary_hits": 0, "hit_kinds": {}}}
    return checkpoint.capture(strategy, rec, audit, round_idx, [])


def test_a_checkpoint_round_trips_the_strategy_state_exactly(cfg, tmp_path):
    ckpt = tiny_checkpoint(cfg)
    path = checkpoint.save(tmp_path / "run", ckpt, cfg, key=KEY_BYTES)
    back = checkpoint.latest(tmp_path / "run", cfg, key=KEY_BYTES)
    assert path.name == "ckpt-r001-p0.bin" and back.round == 1 and back.phases_done == []
    assert set(back.groups) == {"tiny-llama", "tiny-qwen2"}
    for model, g in ckpt.groups.items():
        b = back.groups[model]
        assert (b.global_rank, b.global_alpha, b.info) == (g.global_rank, g.global_alpha, g.info)
        assert set(b.per_client) == set(g.per_client)
        for got, want in [(b.global_state, g.global_state),
                          *[(b.per_client[p], g.per_client[p]) for p in g.per_client]]:
            assert list(got) == list(want)  # same keys, same order
            for k in want:
                assert got[k].dtype == np.float32 and got[k].shape == want[k].shape
                assert got[k].tobytes() == want[k].tobytes()
    llama = back.groups["tiny-llama"]
    assert llama.info["method"] == "flexlora" and set(llama.info["truncation_error"]) == {4, 8}  # int keys
    assert llama.per_client[0][f"{KEY}.lora_A.weight"].shape == (4, 16)
    assert llama.per_client[1][f"{KEY}.lora_A.weight"].shape == (8, 16)
    assert back.shapes == {"tiny-llama": {KEY: (16, 16)}, "tiny-qwen2": {KEY: (16, 16)}}
    assert back.audit == ckpt.audit
    # results as results.json has them: the private text scrubbed, the numbers exact
    row = back.results["rounds"][0]["clients"][0]
    assert row["train_loss"] == 1.0 and row["text"].startswith("<text 14 chars hmac:")
    assert "private prompt" not in path.read_bytes().decode("latin-1")
    # the server's RNG states come back: the next draws equal those after the save
    import random

    import torch

    checkpoint.restore_rng(ckpt)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    checkpoint.restore_rng(back)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_restore_puts_groups_results_and_audit_back(cfg, tmp_path):
    ckpt = tiny_checkpoint(cfg)
    strategy, rec = GroupedLoRA(cfg), RunRecorder(tmp_path, cfg)

    class Grid:
        totals: dict = {}

    grid = Grid()
    checkpoint.restore(ckpt, strategy, rec, grid)
    assert strategy.groups == ckpt.groups and strategy.shapes == ckpt.shapes
    assert grid.totals == ckpt.audit and rec.results["status"] == "running"
    assert rec.results["rounds"] == ckpt.results["rounds"]
    assert rec.results["summary"]["out_dir"] == str(tmp_path)


def _two_checkpoints(cfg, out: Path) -> tuple[Path, Path]:
    p1 = checkpoint.save(out, tiny_checkpoint(cfg, 1), cfg, key=KEY_BYTES)
    p2 = checkpoint.save(out, tiny_checkpoint(cfg, 2), cfg, key=KEY_BYTES)
    return p1, p2


@pytest.mark.parametrize("damage", ["truncate", "flip_a_weight_byte", "flip_metadata",
                                    "other_key", "empty"])
def test_a_damaged_or_forged_checkpoint_is_ignored_and_the_previous_one_used(cfg, tmp_path, caplog, damage):
    out = tmp_path / "run"
    p1, p2 = _two_checkpoints(cfg, out)
    data = bytearray(p2.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_a_weight_byte":
        data[-3] ^= 0x01  # the last array's bytes
    elif damage == "flip_metadata":
        i = bytes(data).index(b'\\"round\\": 2')  # the metadata is JSON inside a JSON string
        data[i + 11] = ord("1")  # "round": 1 -- a forged position
    elif damage == "other_key":  # re-signed by someone without this run's key
        body = bytes(data[40:])
        forged = checkpoint.encode(tiny_checkpoint(cfg, 2), cfg, key=bytes(32))
        assert forged[40:] == body  # the very same content, only the MAC differs
        data = bytearray(forged)
    else:
        data = bytearray()
    p2.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        checkpoint.decode(bytes(data), cfg, KEY_BYTES)
    with caplog.at_level(logging.WARNING):
        back = checkpoint.latest(out, cfg, key=KEY_BYTES)
    assert back is not None and back.round == 1  # fell back to round 1's file
    assert any("ignoring" in r.getMessage() and p2.name in r.getMessage() for r in caplog.records)
    p1.write_bytes(p1.read_bytes()[:100])
    assert checkpoint.latest(out, cfg, key=KEY_BYTES) is None  # nothing usable: start afresh


@pytest.mark.parametrize("bad", ["nan", "rank", "round", "partition"])
def test_an_authentic_checkpoint_with_unusable_content_is_refused(cfg, bad):
    """Signed with the right key, but not a state this federation can continue from."""
    ckpt = tiny_checkpoint(cfg)
    g = ckpt.groups["tiny-qwen2"]
    if bad == "nan":
        g.global_state[f"{KEY}.lora_B.weight"][0, 0] = np.nan
        match = "NaN"
    elif bad == "rank":
        ckpt.groups["tiny-llama"].per_client[0] = lora(8, 5)  # partition 0 runs rank 4
        match = "rank 4"
    elif bad == "round":
        ckpt.round = 3  # the tiny federation has 2 rounds
        match = "round 3"
    else:
        g.per_client = {0: g.global_state}  # partition 0 runs tiny-llama
        match = "partition 0"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.decode(checkpoint.encode(ckpt, cfg, KEY_BYTES), cfg, KEY_BYTES)


def test_a_checkpoint_of_another_config_is_refused_in_one_line(cfg, tmp_path):
    out = tmp_path / "run"
    checkpoint.save(out, tiny_checkpoint(cfg), cfg, key=KEY_BYTES)
    other = compose("tiny", [f"paths.cache_dir={tmp_path / 'cache'}", "training.lr=0.5"])
    with pytest.raises(CheckpointMismatch) as e:
        checkpoint.latest(out, other, key=KEY_BYTES)
    msg = str(e.value)
    assert "\n" not in msg and "training.lr: 0.01 -> 0.5" in msg and "another config" in msg
    # the outputs root alone does not make another config (it only chose the folder)
    moved = compose("tiny", [f"paths.cache_dir={tmp_path / 'cache'}", f"outputs.root={tmp_path}"])
    assert checkpoint.latest(out, moved, key=KEY_BYTES).round == 1


def test_scrubbing_twice_changes_nothing_but_a_tag_with_text_after_it_is_scrubbed():
    tag = scrub_text("my secret prompt")
    assert scrub_text(tag) == tag
    assert redact_results({"rounds": [{"text": tag}]})["rounds"][0]["text"] == tag
    sneaky = tag + " my secret prompt"
    assert "secret" not in scrub_text(sneaky)


# --------------------------------------------------------------------------- server, fake Grid


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no handler catches BaseException here but
    the ServerApp's, which marks the run failed and re-raises)."""


class ChainGrid(FakeGrid):
    """The fake tiny federation whose train replies continue from the adapter the server
    sent (half of it plus a per-partition, per-round step), so every round depends on the
    state the previous rounds left on the server. ``kill_at``: raise :class:`Killed` when
    the train messages of that round are sent."""

    def __init__(self, log, kill_at: int | None = None, answers=None):
        super().__init__(log, answers)
        self.kill_at = kill_at

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train" and int(m.content["config"]["round"]) == self.kill_at:
                raise Killed(f"killed in round {self.kill_at}")
        return super().send_and_receive(messages, timeout=timeout)

    def _answer(self, kind, msg):
        content = super()._answer(kind, msg)
        if kind != "train":
            return content
        pid, model, rank = CLIENTS[msg.metadata.dst_node_id]
        r = int(msg.content["config"]["round"])
        step = lora(rank, 100 * pid + r, scale=0.5)
        if "adapter" in msg.content:
            sent = unpack_adapter({k: v.numpy() for k, v in msg.content["adapter"].items()},
                                  str(msg.content["config"]["adapter_index"]))
            new = {k: (0.5 * sent[k] + step[k]).astype(np.float32) for k in step}
        else:
            new = step
        arrays, index = pack_adapter(new)
        from flwr.app import Array, ArrayRecord

        content["adapter"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        content["meta"]["adapter_index"] = index
        return content


def _strip_timing(obj):
    """``obj`` without timings and adapter folders; a round's group rows sorted by model
    (they come in reply order, which no run fixes)."""
    if isinstance(obj, dict):
        out = {k: _strip_timing(v) for k, v in obj.items() if "seconds" not in k and k != "adapter_dir"}
        if isinstance(out.get("groups"), list):
            out["groups"] = sorted(out["groups"], key=lambda g: g["model"])
        return out
    if isinstance(obj, list):
        return [_strip_timing(v) for v in obj]
    return obj


def _same_groups(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for m in a:
        assert (a[m].global_rank, a[m].global_alpha) == (b[m].global_rank, b[m].global_alpha)
        for got, want in [(a[m].global_state, b[m].global_state),
                          *[(a[m].per_client[p], b[m].per_client[p]) for p in b[m].per_client]]:
            assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}


def test_a_run_killed_in_round_2_resumes_and_ends_as_an_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "PHASES", [])
    off = f"{OFF} paths.cache_dir={tmp_path / 'cache'}"
    cfg = compose("tiny", [*off.split(), "federation.num_rounds=3"])
    ref = run_main(tmp_path / "ref", ChainGrid([]), off, rounds=3)
    ref_ckpt = checkpoint.latest(tmp_path / "ref" / "run", cfg)

    with pytest.raises(Killed):
        run_main(tmp_path / "kill", ChainGrid([], kill_at=2), off, rounds=3)
    folder = tmp_path / "kill" / "run"
    assert [p.name for p in checkpoint.files(folder)] == ["ckpt-r001-p0.bin"]
    log = []
    res = run_main(tmp_path / "kill", ChainGrid(log), off, rounds=3)
    one_round = ["train"] * 4 + ["evaluate"] * 4
    # new node ids are identified again, then rounds 2 and 3 only: round 1 is not retrained
    assert log == ["query.info"] * 4 + one_round * 2
    assert res["status"] == "completed" and res["summary"]["resumed"] == [
        {"after_round": 1, "phases_done": []}]
    assert _strip_timing(res["rounds"]) == _strip_timing(ref["rounds"])
    got = checkpoint.latest(folder, cfg)
    assert got.round == 3
    _same_groups(got.groups, ref_ckpt.groups)


def test_completed_phases_are_not_rerun_and_an_unfinished_one_runs_from_its_start(tmp_path, monkeypatch):
    off = f"{OFF} paths.cache_dir={tmp_path / 'cache'}"
    log = []
    monkeypatch.setattr(phases, "PHASES", [recording("a", log, {"a": [1, 2]}),
                                           recording("b", log, fail="b broke")])
    with pytest.raises(RuntimeError, match="b broke"):
        run_main(tmp_path, ChainGrid(log), off, rounds=2)
    assert "a.run (round 2 of 2)" in log and log[-1] == "b.run (round 2 of 2)"
    folder = tmp_path / "run"
    assert checkpoint.files(folder)[-1].name == "ckpt-r002-p1.bin"  # after round 2 and phase a

    log.clear()
    monkeypatch.setattr(phases, "PHASES", [recording("a", log, {"a": [9]}),
                                           recording("b", log, {"b": [3]})])
    res = run_main(tmp_path, ChainGrid(log), off, rounds=2)
    assert log == ["a.start", "b.start", *["query.info"] * 4, "b.after_round 2",
                   "b.run (round 2 of 2)"]
    assert res["status"] == "completed" and res["error"] is None
    assert res["a"] == [1, 2] and res["b"] == [3]  # a's rows from before the restart
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert set(res["summary"]["phase_seconds"]) == {"a", "b"}
    assert checkpoint.files(folder)[-1].name == "ckpt-r002-p2.bin"

    log.clear()  # everything done: a third start runs nothing and keeps the results
    again = run_main(tmp_path, ChainGrid(log), off, rounds=2)
    assert log == ["a.start", "b.start"] and again["a"] == [1, 2] and again["b"] == [3]


def test_the_server_refuses_a_folder_of_another_config_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "PHASES", [])
    off = f"{OFF} paths.cache_dir={tmp_path / 'cache'}"
    run_main(tmp_path, ChainGrid([]), off, rounds=1)
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    log = []
    with pytest.raises(CheckpointMismatch, match="federation.num_rounds: 1 -> 2"):
        run_main(tmp_path, ChainGrid(log), off, rounds=2)
    assert log == []  # refused before any message
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


# --------------------------------------------------------------------------- integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(home: Path) -> list[psutil.Process]:
    """The SuperLink ``flwr`` started under ``home`` and all its descendants (SuperExec,
    the simulation, Ray's processes and workers)."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if any(c.endswith("flower-superlink") for c in cmd[:2]) and any(str(home) in c for c in cmd):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = {}
    for r in roots:
        found[r.pid] = r
        try:
            found.update({c.pid: c for c in r.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


@contextmanager
def own_superlink(home: Path):
    """Environment for ``edgefuse run`` with a SuperLink of its own (``FLWR_HOME`` = ``home``,
    free ports); on exit that SuperLink and everything under it is killed and must be gone."""
    import httpx

    from edgefuse.cli.launch import FLOWER_ENV

    home.mkdir(parents=True, exist_ok=True)
    http, control = _free_port(), _free_port()
    # FLOWER_ENV as the launcher gives `flwr`: no `uv sync` of the app's dependencies
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control), "EDGEFUSE_DATA_MIRROR": str(mirror_path()),
           "FLWR_DISABLE_UPDATE_CHECK": "1",  # and flower-superexec on the PATH:
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    # Started here as `flwr` would (flwr.cli.local_superlink), because `flwr` gives it only
    # 15 s to come up, which a loaded machine can miss; `flwr run` then finds it running.
    state = home / "local-superlink"
    state.mkdir(exist_ok=True)
    superlink = subprocess.Popen(
        [str(Path(sys.executable).parent / "flower-superlink"), "--insecure", "--simulation",
         "--isolation", "subprocess", "--control-api-address", f"127.0.0.1:{control}",
         "--host", "127.0.0.1", "--port", str(http), "--log-file", str(state / "superlink.log"),
         "--database", str(state / "state.db")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert superlink.poll() is None, (state / "superlink.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the SuperLink did not come up in 300 s"
            time.sleep(0.5)
        yield env
    finally:
        seen: dict[int, psutil.Process] = {}
        for _ in range(3):  # again, for anything started while we were killing
            procs = [p for p in _tree(home) if p.pid != os.getpid()]
            for p in procs:
                seen[p.pid] = p
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=30)
        alive = [p.pid for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive and not _tree(home), f"left behind: {alive}"


def _launch(out: Path, env: dict, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "edgefuse.cli", "run", "experiment=tiny", "c2c=disabled",
           "cloud=disabled", "privacy=disabled", f"hydra.run.dir={out}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.integration
def test_a_sigkilled_federation_resumes_bit_for_bit(tmp_path):
    if mirror_path() is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
    from safetensors.numpy import load_file

    ref, run = tmp_path / "ref", tmp_path / "run"
    with own_superlink(tmp_path / "home-ref") as env:
        proc = _launch(ref, env, tmp_path / "ref.log")
        assert proc.wait(timeout=1500) == 0, (tmp_path / "ref.log").read_text()[-3000:]

    with own_superlink(tmp_path / "home-kill") as env:
        proc = _launch(run, env, tmp_path / "kill.log")
        first = run / "checkpoint" / "ckpt-r001-p0.bin"
        deadline = time.monotonic() + 1500
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists() and proc.poll() is None, (tmp_path / "kill.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and `flwr run`
        proc.wait(timeout=60)
    # the killed run's simulation is gone (own_superlink checked it) and had not finished round 2
    assert [p.name for p in checkpoint.files(run)] == ["ckpt-r001-p0.bin"]
    assert json.loads((run / JSON_NAME).read_text())["status"] == "running"

    with own_superlink(tmp_path / "home-resume") as env:
        proc = _launch(run, env, tmp_path / "resume.log")
        code = proc.wait(timeout=1500)
    out = (tmp_path / "resume.log").read_text()
    assert code == 0, out[-3000:]
    assert "resume: continuing after round 1 of 2" in out
    assert "round 2/2: training" in out and "round 1/2: training" not in out

    a, b = json.loads((ref / JSON_NAME).read_text()), json.loads((run / JSON_NAME).read_text())
    assert a["status"] == b["status"] == "completed"
    assert b["summary"]["resumed"] == [{"after_round": 1, "phases_done": []}]
    assert _strip_timing(b["rounds"]) == _strip_timing(a["rounds"])
    models = sorted(p.name for p in (ref / "adapters" / "round_002").iterdir())
    assert models == ["tiny-gemma3", "tiny-llama", "tiny-qwen2"]
    for m in models:  # the final global adapters, bit for bit
        want = load_file(ref / "adapters" / "round_002" / m / "adapter_model.safetensors")
        got = load_file(run / "adapters" / "round_002" / m / "adapter_model.safetensors")
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(b["config"])
    _same_groups(checkpoint.latest(run, cfg).groups, checkpoint.latest(ref, cfg).groups)


def test_edgefuse_run_refuses_a_folder_of_another_config_in_one_line(tmp_path):
    """Before `flwr` starts: exit 2, one line naming the key, the folder left as it was."""
    if mirror_path() is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
    home = tmp_path / "flwr-home"  # were `flwr` started after all, its SuperLink would be ours
    env = {**os.environ, "EDGEFUSE_DATA_MIRROR": str(mirror_path()), "FLWR_HOME": str(home),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    cache, run = tmp_path / "cache", tmp_path / "run"
    other = compose("tiny", [f"paths.cache_dir={cache}", f"data.mirror={mirror_path()}",
                             "c2c=disabled", "training.lr=0.5"])
    checkpoint.save(run, tiny_checkpoint(other), other)
    (run / JSON_NAME).write_text('{"config": {}, "rounds": [], "status": "running"}\n')

    def files():  # Hydra rewrites .hydra/ at every launch
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts}

    before = files()
    try:
        proc = subprocess.run([sys.executable, "-m", "edgefuse.cli", "run", "experiment=tiny",
                               "c2c=disabled", f"paths.cache_dir={cache}", f"hydra.run.dir={run}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        for p in _tree(home):
            p.kill()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("edgefuse: error:")]
    assert len(err) == 1 and "another config" in err[0] and "training.lr: 0.5 -> 0.01" in err[0], proc.stderr
    assert "flwr run" not in proc.stdout  # refused before the federation started
    assert files() == before
