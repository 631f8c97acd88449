"""Every override example the docs give composes: ``edgefuse run ...`` and
``make run|smoke ARGS="..."`` lines in README.md, docs/running.md, the Makefile and
conf/config.yaml, and the ``overrides`` example in pyproject.toml's Flower app config, each
checked as ``edgefuse run`` checks its arguments before Hydra starts."""

import re
import shlex

import pytest

from edgefuse.cli.common import CLIError
from edgefuse.cli.main import _check_run_overrides
from tests.conftest import ROOT

SOURCES = ["README.md", "docs/running.md", "Makefile", "edgefuse/conf/config.yaml", "pyproject.toml"]
PATTERNS = [
    re.compile(r"edgefuse run((?: +(?:'[^'\n]*'|[^\s`'#]+))*)"),  # edgefuse run a=1 'b=[x,y]'
    re.compile(r'make (?:run|smoke) ARGS="([^"\n]*)"'),          # make run ARGS="a=1 b=2"
    re.compile(r'overrides=\\?"([^"\\]*)\\?"'),                 # flwr's --run-config overrides="..."
]


def examples() -> list[tuple[str, str]]:
    """``(source, override string)`` for every example found; words holding a shell
    expansion (``$(ARGS)``) are dropped, placeholders such as ``outputs.root=...`` stay (they must compose too)."""
    found = []
    for name in SOURCES:
        text = (ROOT / name).read_text()
        if name == "pyproject.toml":  # the comment above `overrides = ""` in the app config
            block = text.split("[tool.flwr.app.config]", 1)[1].split("\n[", 1)[0]
            found += [(name, m.group(1)) for m in re.finditer(r'e\.g\. "([^"]*)"', block)]
            continue
        for pat in PATTERNS:
            found += [(name, m.group(1)) for m in pat.finditer(text)]
    out = []
    for name, example in found:
        words = [w for w in shlex.split(example) if "$" not in w and ("=" in w or w.startswith("-"))]
        if words:
            out.append((name, shlex.join(words)))
    return out


EXAMPLES = examples()


def test_the_examples_are_found():
    by_source = {n for n, _ in EXAMPLES}
    assert by_source == set(SOURCES), by_source
    assert len(EXAMPLES) >= 12
    assert ("docs/running.md", "--multirun experiment=smoke training.lr=1e-4,3e-4") in EXAMPLES
    assert ("docs/running.md", "cloud.wan=wan20 cloud.devices=4 'cloud.modes=[cloud,spec_async]'") in EXAMPLES


@pytest.mark.parametrize("source, example", EXAMPLES, ids=[f"{n}:{e}" for n, e in EXAMPLES])
def test_example_composes(source, example):
    try:
        _check_run_overrides(shlex.split(example))
    except CLIError as e:
        pytest.fail(f"{source}: `{example}` does not compose: {e}")


def test_a_rotten_example_is_caught():
    with pytest.raises(CLIError, match="training.steps"):
        _check_run_overrides(shlex.split("training.steps=5 federation=smoke"))
