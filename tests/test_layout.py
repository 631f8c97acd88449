"""The package layout: one import package, the layer contract, no import cycles, a light core."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layer_contract_and_no_cycles_hold():
    """``lint-imports`` checks the layers and the acyclic contract in pyproject.toml (imports
    inside functions included); it exits non-zero when either is broken."""
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "3 kept, 0 broken" in res.stdout


def test_layer_contract_catches_an_upward_import_inside_a_function(tmp_path):
    """The contract is not vacuous: a copy of the package whose core imports the cloud layer
    inside a function breaks it."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(ROOT / "edgefuse", copy / "edgefuse", ignore=shutil.ignore_patterns("__pycache__", "conf"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    bad = copy / "edgefuse" / "packing.py"
    bad.write_text(bad.read_text() + "\n\ndef _sneak():\n    from edgefuse.cloud import protocol  # noqa\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([str(lint)], cwd=copy, capture_output=True, text=True, env=env)
    assert res.returncode != 0
    assert "edgefuse.packing is not allowed to import edgefuse.cloud" in res.stdout


def test_only_edgefuse_is_installed_as_a_top_level_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["tool"]["setuptools"]["packages"]["find"]["include"] == ["edgefuse*"]
    comps = cfg["tool"]["flwr"]["app"]["components"]
    assert comps["serverapp"].startswith("edgefuse.") and comps["clientapp"].startswith("edgefuse.")
    tops = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert tops <= {"edgefuse", "tests"}, tops
    assert (ROOT / "edgefuse" / "conf" / "config.yaml").is_file()


def test_core_modules_do_not_import_plotting_or_flower():
    """A device importing the LoRA code, the model loader or the fuser registry loads neither
    matplotlib (results layer) nor Flower (app layer)."""
    code = ("import sys, edgefuse.lora, edgefuse.models, edgefuse.io, edgefuse.c2c.registry; "
            "print(sorted(m for m in ('matplotlib', 'flwr') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout
