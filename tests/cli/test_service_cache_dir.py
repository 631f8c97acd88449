"""The run's model cache (``paths.cache_dir``, pinned by ``edgefuse run``) reaches the cloud
service the decoding phase starts: phase -> start_service_process -> the child's command
line -> ``edgefuse cloud serve --cache-dir`` -> the cache the service loads from."""

import os
import types

import pytest

from edgefuse import models
from edgefuse.app.phases import decoding as decoding_phase
from edgefuse.app.strategy import NodeInfo
from edgefuse.cli.main import main
from edgefuse.cloud import service
from edgefuse.config import compose


class Started(Exception):
    """Raised by a fake to stop right after the call under test."""


def test_decoding_phase_passes_the_runs_cache_dir(tmp_path, monkeypatch):
    cfg = compose("tiny", [f"paths.cache_dir={tmp_path}/run-cache", "data.mirror=hub"])
    seen = {}

    def start(model, host, port, **kw):
        seen.update(model=model, **kw)
        raise Started
    monkeypatch.setattr(service, "start_service_process", start)
    monkeypatch.setattr(decoding_phase, "load_queries", lambda cfg: [])
    node = NodeInfo(node_id=7, partition_id=2, model="tiny-qwen2", lora_rank=4)
    ctx = types.SimpleNamespace(cfg=cfg, strategy=types.SimpleNamespace(nodes={7: node}), out=tmp_path)
    with pytest.raises(Started):
        decoding_phase.Decoding().run(ctx)
    assert seen["model"] == str(cfg.cloud.model)
    assert seen["cache_dir"] == str(tmp_path / "run-cache")


def test_service_command_line_carries_the_cache_dir(tmp_path, monkeypatch):
    calls = []

    class ExitsAtOnce:
        def __init__(self, cmd, env=None, **kw):
            calls.append((cmd, env))

        def poll(self):
            return 3
    monkeypatch.setattr(service.subprocess, "Popen", ExitsAtOnce)
    with pytest.raises(service.ServiceStartError, match="exited with code 3"):
        service.start_service_process("tiny-qwen2", cache_dir=tmp_path / "c", log_path=tmp_path / "log")
    (cmd, env), = calls
    assert cmd[1:6] == ["-m", "edgefuse.cli", "cloud", "serve", "--model"]
    assert cmd[cmd.index("--cache-dir") + 1] == str(tmp_path / "c")
    calls.clear()
    with pytest.raises(service.ServiceStartError):
        service.start_service_process("tiny-qwen2", log_path=tmp_path / "log")
    assert "--cache-dir" not in calls[0][0]  # None: the child's own resolution


def test_cloud_serve_loads_from_its_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFUSE_CACHE", str(tmp_path / "elsewhere"))  # restored after the test
    seen = {}

    def serve(model, host, port, **kw):
        seen.update(model=model, cache=models.cache_dir(), port=port)
    monkeypatch.setattr(service, "serve", serve)
    assert main(["cloud", "serve", "--model", "tiny-qwen2", "--port", "0", "--cache-dir",
                 str(tmp_path / "mine")]) == 0
    assert seen == {"model": "tiny-qwen2", "cache": tmp_path / "mine", "port": 0}


@pytest.mark.integration
def test_real_service_loads_the_model_from_the_given_cache(tmp_path):
    """A cache holding SmolLM2 (linked from the default cache, fetched there if missing) is
    passed as cache_dir; the child's own EDGEFUSE_CACHE is empty and pip has no index, so
    the service can only start if it loads from the cache it was given."""
    real = models.fetch("smollm2-135m")
    given = tmp_path / "given"
    (given / "models").mkdir(parents=True)
    (given / "models" / "smollm2-135m").symlink_to(real)
    env = {**os.environ, "EDGEFUSE_CACHE": str(tmp_path / "empty"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": ""}
    from edgefuse.app.device import keys_root

    identity, authorized = service.default_service_keys(keys_root())  # before EDGEFUSE_CACHE moves
    proc, port = service.start_service_process("smollm2-135m", cache_dir=given, env=env,
                                               identity_path=identity, authorized_path=authorized,
                                               log_path=tmp_path / "service.log", timeout_s=300)
    try:
        from edgefuse.cloud.link import cloud_health

        assert cloud_health("127.0.0.1", port, timeout_s=10)["model"] == "smollm2-135m"
    finally:
        assert service.stop_service_process(proc) == 0
    assert not (tmp_path / "empty").exists()  # nothing was fetched into the child's default
