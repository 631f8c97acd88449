"""Shared fixtures: the offline data mirror and a helper to find it."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mirror_path() -> Path | None:
    """The data mirror: $EDGEFUSE_DATA_MIRROR, else ../shared/data beside the checkout."""
    env = os.environ.get("EDGEFUSE_DATA_MIRROR")
    for cand in (env, ROOT.parent / "shared" / "data"):
        if cand and (Path(cand) / "dolly").is_dir():
            return Path(cand).resolve()
    return None


@pytest.fixture(scope="session", autouse=True)
def provisioned_keys() -> Path:
    """Identities for the cloud and 8 devices under this machine's keys root, as `edgefuse
    run` makes them before a federation (kept if present). Returns the keys root."""
    from edgefuse.app.device import keys_root
    from edgefuse.transport.identity import provision

    provision(keys_root(), 8)
    return keys_root()


@pytest.fixture
def mirror() -> Path:
    path = mirror_path()
    if path is None:
        pytest.skip("no data mirror: set EDGEFUSE_DATA_MIRROR or place ../shared/data")
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and far faster than two on a busy CPU)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
