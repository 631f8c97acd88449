"""``edgefuse keys``: init prints what provisioning made, show lists an identity and its pins,
safety-number is the same on both ends unless a pin was swapped; every error is one line."""

import os

import pytest

from edgefuse.cli.main import main
from edgefuse.transport.identity import (Identity, TrustStore, device_dir, fingerprint, load_identity,
                                         safety_number)
from tests.cli.test_cli_errors import cli


def run(capsys, *args) -> list[str]:
    assert main(list(args)) == 0
    return capsys.readouterr().out.splitlines()


def test_init_show_and_safety_number(tmp_path, capsys):
    root = str(tmp_path)
    out = run(capsys, "keys", "init", "--partitions", "2", "--root", root)
    keys = {n: load_identity(device_dir(tmp_path, p) / "identity.key") for p, n in enumerate(["device-0", "device-1"])}
    keys["cloud"] = load_identity(tmp_path / "cloud" / "identity.key")
    assert out == [f"{n:<12} {keys[n].fingerprint}" for n in ("cloud", "device-0", "device-1")] + [f"keys root: {tmp_path}"]
    assert run(capsys, "keys", "init", "--partitions", "2", "--root", root) == out  # kept, not remade

    shown = run(capsys, "keys", "show", "--device-dir", str(device_dir(tmp_path, 1)))
    assert shown == [f"device-1  {keys['device-1'].fingerprint}  ({device_dir(tmp_path, 1)})"] + [
        f"  pins {n:<12} {keys[n].fingerprint}" for n in ("cloud", "device-0", "device-1")]
    every = run(capsys, "keys", "show", "--root", root)
    assert [line.split("  ")[0] for line in every if not line.startswith(" ")] == ["cloud", "device-0", "device-1"]

    want = safety_number(keys["device-0"].public_bytes(), keys["device-1"].public_bytes())
    assert len(want.replace(" ", "")) == 60
    line = f"device-0 <-> device-1: {want}"
    assert run(capsys, "keys", "safety-number", "device-0", "device-1", "--root", root) == [line]
    # each operator on their own device: its own key and its pin for the other
    assert run(capsys, "keys", "safety-number", "device-0", "device-1", "--device-dir",
               str(device_dir(tmp_path, 0))) == [line]
    assert run(capsys, "keys", "safety-number", "device-1", "device-0", "--device-dir",
               str(device_dir(tmp_path, 1))) == [f"device-1 <-> device-0: {want}"]


def test_a_swapped_pin_shows_as_a_different_safety_number(tmp_path, capsys, monkeypatch):
    """Someone replaced device-1's pin for device-0: the two operators read different numbers
    (the keys root holds the real key files, so reading those instead of the pin would hide it)."""
    monkeypatch.setenv("EDGEFUSE_KEYS", str(tmp_path))
    run(capsys, "keys", "init", "--partitions", "2", "--root", str(tmp_path))
    store = TrustStore.load(device_dir(tmp_path, 1) / "trust.json")
    evil = Identity.generate()
    store.pin("device-0", evil.public_bytes(), replace=True)
    store.save()
    on_0 = run(capsys, "keys", "safety-number", "device-0", "device-1", "--device-dir", str(device_dir(tmp_path, 0)))
    on_1 = run(capsys, "keys", "safety-number", "device-0", "device-1", "--device-dir", str(device_dir(tmp_path, 1)))
    assert on_0 != on_1
    assert f"  pins device-0     {fingerprint(evil.public_bytes())}" in run(
        capsys, "keys", "show", "--device-dir", str(device_dir(tmp_path, 1)))


def test_errors_are_one_line(tmp_path):
    root = str(tmp_path)
    rc, line = cli("keys", "init", "--partitions", "0", "--root", root)
    assert rc == 2 and line == "edgefuse: error: num_partitions must be in 1..4096, got 0"
    # the attack: a huge count would fill the disk with device folders; refused before any
    rc, line = cli("keys", "init", "--partitions", "100000000", "--root", str(tmp_path / "huge"))
    assert rc == 2 and line == "edgefuse: error: num_partitions must be in 1..4096, got 100000000"
    assert not (tmp_path / "huge" / "devices").exists()
    rc, line = cli("keys", "show", "--root", str(tmp_path / "none"))
    assert rc == 2 and line.startswith(f"edgefuse: error: no identities under {tmp_path / 'none'}")
    assert main(["keys", "init", "--partitions", "1", "--root", root]) == 0
    rc, line = cli("keys", "safety-number", "device-0", "device-9", "--root", root)
    assert rc == 2 and line.startswith("edgefuse: error: no identity for device-9 at ")
    rc, line = cli("keys", "safety-number", "device-0", "../etc", "--root", root)
    assert rc == 2 and line.startswith("edgefuse: error: bad identity name '../etc'")
    rc, line = cli("keys", "safety-number", "device-0", "bob", "--root", root)
    assert rc == 2 and line == "edgefuse: error: unknown name 'bob': use cloud or device-<partition id>"
    rc, line = cli("keys", "safety-number", "device-0", "device-5", "--device-dir", str(device_dir(tmp_path, 0)))
    assert rc == 2 and line.startswith("edgefuse: error: no key is pinned for 'device-5'")
    os.chmod(device_dir(tmp_path, 0) / "identity.key", 0o644)
    rc, line = cli("keys", "show", "--device-dir", str(device_dir(tmp_path, 0)))
    assert rc == 2 and "is readable by others (mode 644); chmod 600 it" in line
    rc, line = cli("keys", "frobnicate")
    assert rc == 2 and line.startswith("edgefuse keys: error: argument cmd: invalid choice")


@pytest.mark.parametrize("argv", [["keys", "show", "--root", "a", "--device-dir", "b"]])
def test_show_takes_one_place(argv):
    rc, line = cli(*argv)
    assert rc == 2 and "not allowed with argument" in line


def test_a_device_makes_its_own_key_and_the_operator_registers_only_the_public_part(tmp_path, capsys):
    dev, ops = tmp_path / "device", tmp_path / "ops"
    line = run(capsys, "keys", "new", "--device-dir", str(dev))[0]
    own = load_identity(dev / "identity.key")
    assert line == f"public key {own.public_bytes().hex()}  fingerprint {own.fingerprint}"
    run(capsys, "keys", "register", "device-1", own.public_bytes().hex(), "--root", str(ops))
    out = run(capsys, "keys", "init", "--partitions", "2", "--root", str(ops))
    assert f"{'device-1':<12} {own.fingerprint}" in out
    assert not (device_dir(ops, 1) / "identity.key").exists()  # the operator never held it
    # the trust.json the operator hands back pins the device's own key for it, and the cloud's
    TrustStore.load(device_dir(ops, 0) / "trust.json").check("device-1", own.public_bytes())
    a = load_identity(device_dir(ops, 0) / "identity.key").public_bytes()
    assert run(capsys, "keys", "safety-number", "device-0", "device-1", "--root", str(ops)) == [
        f"device-0 <-> device-1: {safety_number(a, own.public_bytes())}"]


@pytest.mark.parametrize("args, message", [
    (["register", "device-1", "zz"], "64 hex"),
    (["register", "cloud", "00" * 32], "cloud's identity is made by init"),
    (["register", "device-x", "00" * 32], "unknown name"),
])
def test_register_refusals_are_one_line(tmp_path, args, message):
    code, err = cli("keys", *args, "--root", str(tmp_path))  # cli() checks one line, no traceback
    assert code != 0 and message in err
