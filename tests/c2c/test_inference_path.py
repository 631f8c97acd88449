"""Inference never goes through training code: the C2C query-time path (edgefuse.c2c.peer)
builds its pair examples from edgefuse.c2c.examples, and import-linter forbids it
edgefuse.c2c.train (imports inside functions included)."""

import shutil
import subprocess
import sys
from pathlib import Path

from edgefuse.c2c import examples, peer

ROOT = Path(__file__).resolve().parents[2]


def test_peer_builds_pair_examples_from_the_shared_module():
    assert peer.build_pair_example is examples.build_pair_example
    assert "edgefuse.c2c.train" not in {getattr(v, "__module__", None) for v in vars(peer).values()}


def _lint(tmp_path, sneak: str):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "edgefuse", copy / "edgefuse", ignore=shutil.ignore_patterns("__pycache__", "conf"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    bad = copy / "edgefuse" / "c2c" / "peer.py"
    bad.write_text(bad.read_text() + f"\n\ndef _sneak():\n    {sneak}  # noqa\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(lint)], cwd=copy, capture_output=True, text=True, env=env)


def test_contract_catches_training_import_inside_a_function(tmp_path):
    res = _lint(tmp_path, "from edgefuse.c2c.train import train_fuser")
    assert res.returncode != 0
    assert "the C2C query-time path does not import fuser training BROKEN" in res.stdout
    assert "edgefuse.c2c.peer -> edgefuse.c2c.train" in res.stdout


def test_query_path_loads_no_training_module_at_run_time():
    """The contract reads import statements; this checks what actually loads (package
    ``__init__`` re-exports included)."""
    code = ("import sys, edgefuse.c2c.peer, edgefuse.c2c.multi, edgefuse.c2c.examples; "
            "print(sorted(m for m in ('edgefuse.c2c.train', 'edgefuse.c2c.gate_train') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout
