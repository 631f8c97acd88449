"""The secure deployment: certificates and SuperNode keys (edgefuse.cli.deploy) and
scripts/deploy_local.sh with real flwr 1.42 processes over TLS with SuperNode authentication.

The integration tests start a SuperLink and SuperNodes on ports of their own (not Flower's
defaults) with their own FLWR_HOME, and kill every process they started. In deployment every
Flower message starts a fresh ClientApp process (torch imported each time), so the federation
they run is the ``tiny`` experiment cut to 2 clients, 1 round and no phases."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from edgefuse.cli import deploy
from edgefuse.cli.main import main
from edgefuse.results import load_results
from tests.conftest import ROOT, mirror_path

VENV_BIN = Path(sys.executable).parent
SCRIPT = ROOT / "scripts" / "deploy_local.sh"
SMALL = ["federation.clients=[{model:tiny-llama,lora_rank:4},{model:tiny-qwen2,lora_rank:4}]",
         "federation.num_rounds=1", "c2c=disabled", "cloud=disabled", "privacy=disabled"]
FLOWER = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp",
          "flwr-clientapp", "flwr-simulation")


# ---- certificates and keys ------------------------------------------------------------

def test_server_certificate_verifies_against_its_ca_only(tmp_path):
    certs = deploy.write_certs(tmp_path / "c", ["pi-link.local", "10.1.2.3"])
    ca, cert = certs.ca_cert.read_bytes(), certs.server_cert.read_bytes()
    for host in ("localhost", "127.0.0.1", "::1", "pi-link.local", "10.1.2.3"):
        assert deploy.verify_server_cert(ca, cert, host).subject.rfc4514_string() == "CN=pi-link.local"
    with pytest.raises(deploy.DeployKeyError, match="no matching subjectAltName"):
        deploy.verify_server_cert(ca, cert, "attacker.example")
    # the attack: a server certificate from another CA (same names) is refused by this CA
    rogue = deploy.write_certs(tmp_path / "rogue", ["pi-link.local", "10.1.2.3"])
    with pytest.raises(deploy.DeployKeyError, match="does not verify"):
        deploy.verify_server_cert(ca, rogue.server_cert.read_bytes(), "pi-link.local")
    parsed = x509.load_pem_x509_certificate(cert)
    assert parsed.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert parsed.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
        x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH])
    for path in (certs.ca_key, certs.server_key):
        assert path.stat().st_mode & 0o777 == 0o600
    assert certs.ca_cert.stat().st_mode & 0o777 == 0o644


def test_rerun_keeps_the_ca_and_reissues_the_server_certificate(tmp_path):
    first = deploy.write_certs(tmp_path, [])
    ca, key, cert = (first.ca_cert.read_bytes(), first.ca_key.read_bytes(),
                     first.server_cert.read_bytes())
    again = deploy.write_certs(tmp_path, ["edge-gw"])
    assert (again.ca_cert.read_bytes(), again.ca_key.read_bytes()) == (ca, key)
    assert again.server_cert.read_bytes() != cert
    assert deploy.verify_server_cert(ca, again.server_cert.read_bytes(), "edge-gw")
    first.ca_key.unlink()  # half a CA is refused, nothing is overwritten
    with pytest.raises(deploy.DeployKeyError, match="only one of ca.pem and ca.key"):
        deploy.write_certs(tmp_path, [])
    assert again.ca_cert.read_bytes() == ca


def test_supernode_keys_are_what_flwr_reads(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    folders = deploy.write_supernode_keys(tmp_path, 3)
    assert [f.name for f in folders] == ["partition-0", "partition-1", "partition-2"]
    keys = []
    for d in folders:
        assert (d / deploy.NODE_KEY).stat().st_mode & 0o777 == 0o600
        priv = serialization.load_ssh_private_key((d / deploy.NODE_KEY).read_bytes(), None)
        assert isinstance(priv, ec.EllipticCurvePrivateKey) and priv.curve.name == "secp384r1"
        # flwr supernode register's own loader takes node.pub and gives the key flower-supernode signs with
        assert try_load_public_key(d / deploy.NODE_PUB) == public_key_to_bytes(priv.public_key())
        keys.append((d / deploy.NODE_KEY).read_bytes())
    assert len(set(keys)) == 3
    assert [(d / deploy.NODE_KEY).read_bytes() for d in deploy.write_supernode_keys(tmp_path, 3)] == keys
    (folders[1] / deploy.NODE_KEY).write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n")
    with pytest.raises(deploy.DeployKeyError, match="not an OpenSSH private key"):
        deploy.write_supernode_keys(tmp_path, 3)


@pytest.mark.parametrize("argv, message", [
    (["certs", "--out", "OUT", "--host", "bad host"], "bad host 'bad host'"),
    (["certs", "--out", "OUT", "--host", "*.example.com"], "no wildcards"),
    (["supernode-keys", "--out", "OUT", "--nodes", "0"], r"in \[1, 4096\], got 0"),
])
def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in argv]
    assert main(["deploy", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgefuse: error: ") and err.count("\n") == 1 and re.search(message, err)
    assert not (tmp_path / "o" / "server.pem").exists()


def test_cli_writes_certs_and_keys(tmp_path, capsys):
    assert main(["deploy", "certs", "--out", str(tmp_path), "--host", "10.9.8.7"]) == 0
    assert "localhost, 127.0.0.1, ::1, 10.9.8.7" in capsys.readouterr().out
    assert main(["deploy", "supernode-keys", "--out", str(tmp_path), "--nodes", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "supernodes").iterdir()) == ["partition-0", "partition-1"]


# ---- real processes ---------------------------------------------------------------------

def _free_base(n: int) -> int:
    """A port p with p and p+10 .. p+10+n free on 127.0.0.1 (the script's layout)."""
    for _ in range(200):
        base = 30000 + int.from_bytes(os.urandom(2), "big") % 20000
        ok = True
        for port in [base, *range(base + 10, base + 11 + n)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def _ours(marks: list[str]) -> list[int]:
    """Pids of Flower processes whose command line names one of ``marks`` (our ports / folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(f in args for f in FLOWER) and any(m in args for m in marks):
            pids.append(int(proc.name))
    return pids


@pytest.fixture
def deployment(tmp_path):
    """Environment for one script run (own WORK, FLWR_HOME, ports); afterwards every Flower
    process on those ports or under that folder is killed, and the test fails if one was left."""
    if mirror_path() is None:
        pytest.skip("no data mirror")
    port = _free_base(4)
    work = tmp_path / "work"
    marks = [str(work), *(f"127.0.0.1:{p}" for p in [port, *range(port + 10, port + 16)])]
    env = {**os.environ, "WORK": str(work), "PORT": str(port), "BIN": str(VENV_BIN),
           "EDGEFUSE_OUTPUTS": str(tmp_path / "outputs"), "EDGEFUSE_DATA_MIRROR": str(mirror_path()),
           "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    state = {"env": env, "work": work, "port": port, "marks": marks, "procs": []}
    yield state
    for p in state["procs"]:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    time.sleep(1)
    left = _ours(marks)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"Flower processes left running: {left}"


def _start(state, argv: list[str], log: Path) -> subprocess.Popen:
    p = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=state["env"],
                         start_new_session=True)
    state["procs"].append(p)
    return p


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _serverapp_env(state) -> dict:
    for pid in _ours([f"127.0.0.1:{state['port']}"]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"flwr-serverapp" in cmd:
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
        except OSError:
            continue
    return {}


@pytest.mark.integration
def test_tls_and_supernode_auth_deployment_completes(deployment):
    work, port = deployment["work"], deployment["port"]
    script = _start(deployment, ["bash", str(SCRIPT), "tiny", *SMALL], deployment["work"].parent / "script.log")
    env = _wait_for(lambda: _serverapp_env(deployment) or (script.poll() is not None and {"gone": 1}),
                    420, "the ServerApp process")
    # the ServerApp (started by the SuperLink's SuperExec) has the operator's identities
    assert env.get("EDGEFUSE_KEYS") == str(work / "keys"), (work.parent / "script.log").read_text()[-3000:]
    rc = script.wait(480)
    log = (work.parent / "script.log").read_text()
    assert rc == 0, log[-3000:]
    out = re.search(r"\[deploy\] status: completed - (\S+)", log).group(1)
    results = load_results(out)
    assert results["status"] == "completed"
    rows = results["rounds"][0]["clients"]
    assert sorted(r["partition_id"] for r in rows) == [0, 1] and all(r["status"] == "ok" for r in rows)
    link = (work / "superlink.log").read_text()
    assert f"Uvicorn running on https://127.0.0.1:{port}" in link  # TLS on
    # authentication on: both nodes came in through the Control API (flwr supernode register),
    # none registered itself through the Fleet API
    assert link.count("[ControlServicer.RegisterNode] Created node_id=") == 2
    assert "/v1/fleet/register-node" not in link
    assert (work / "register.log").read_text().count("registered successfully") == 2
    assert "[deploy] SuperLink (TLS + SuperNode authentication) + 2 SuperNodes up" in log
    # devices used their own homes from --node-config
    for i in range(2):
        assert (work / "keys" / "devices" / f"partition-{i}" / "identity.key").stat().st_mode & 0o777 == 0o600
    # the port speaks TLS only: plain HTTP gets no answer
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)


@pytest.mark.integration
def test_unregistered_and_ca_less_supernodes_are_refused(deployment, tmp_path):
    work, port = deployment["work"], deployment["port"]
    one = ["federation.clients=[{model:tiny-llama,lora_rank:4}]", *SMALL[1:]]
    script = _start(deployment, ["bash", str(SCRIPT), "--serve", "tiny", *one], tmp_path / "script.log")
    _wait_for(lambda: "[deploy] ready" in (tmp_path / "script.log").read_text() or script.poll() is not None,
              240, "the deployment to come up")
    assert script.poll() is None, (tmp_path / "script.log").read_text()[-3000:]
    certs = work / "certs"
    # the attack: a SuperNode with a valid key pair that the operator never registered
    stranger = deploy.write_supernode_keys(tmp_path / "stranger", 1)[0] / deploy.NODE_KEY
    base = ["flower-supernode", "--superlink", f"127.0.0.1:{port}", "--max-retries", "1",
            "--max-wait-time", "10", "--node-config", "partition-id=0 num-partitions=1"]
    unreg = _start(deployment, [*base, "--port", str(port + 14), "--root-certificates", str(certs / "ca.pem"),
                                "--auth-supernode-private-key", str(stranger)], tmp_path / "unreg.log")
    # the attack flwr's SuperNode makes by default: no key given, so it registers itself
    keyless = _start(deployment, [*base, "--port", str(port + 13), "--root-certificates", str(certs / "ca.pem")],
                     tmp_path / "keyless.log")
    # and a registered node's own key, but without the CA: it cannot check the server
    no_ca = _start(deployment, [*base, "--port", str(port + 15), "--auth-supernode-private-key",
                                str(certs / "supernodes" / "partition-0" / "node.key")], tmp_path / "noca.log")
    _wait_for(lambda: "Failed to activate SuperNode" in (tmp_path / "unreg.log").read_text(), 120,
              "the unregistered SuperNode's refusal")
    stranger_pub = serialization.load_ssh_private_key(stranger.read_bytes(), None).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    link = (work / "superlink.log").read_text()
    refusal = [line for line in link.splitlines() if "[/v1/fleet/activate-node][ApiError:2004]" in line]
    assert len(refusal) >= 1 and stranger_pub.splitlines()[1] in refusal[0].replace("\\n", "\n")
    assert re.search(r'"POST /v1/fleet/activate-node HTTP/1.1" 412', link)
    _wait_for(lambda: "All SuperNodes must be registered via the CLI" in (tmp_path / "keyless.log").read_text(),
              120, "the keyless SuperNode's refusal")
    link = (work / "superlink.log").read_text()
    assert "[/v1/fleet/register-node][ApiError:2001]" in link
    assert re.search(r'"POST /v1/fleet/register-node HTTP/1.1" 412', link)
    assert no_ca.wait(120) != 0
    noca_log = (tmp_path / "noca.log").read_text()
    assert "CERTIFICATE_VERIFY_FAILED" in noca_log
    # the SuperLink still lists its one registered node, online, and nothing else
    listing = subprocess.run([str(VENV_BIN / "flwr"), "supernode", "list", "deploy", "--format", "json"],
                             capture_output=True, text=True, timeout=60,
                             env={**deployment["env"], "FLWR_HOME": str(work / "flwr")})
    nodes = json.loads(listing.stdout)["nodes"]
    assert [n["status"] for n in nodes] == ["online"]
    for p in (unreg, keyless):
        os.killpg(p.pid, signal.SIGKILL)
    # the script's trap stops everything it started, its SuperExec and app processes too
    os.kill(script.pid, signal.SIGTERM)
    assert script.wait(60) != 0
    time.sleep(2)
    assert _ours([str(work), f"127.0.0.1:{port}", f"127.0.0.1:{port + 10}"]) == []
