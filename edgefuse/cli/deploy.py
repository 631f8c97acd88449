"""Key material of a secure Flower deployment: the SuperLink's TLS certificates and the
SuperNodes' authentication key pairs (``edgefuse deploy ...``).

TLS follows the usual private-PKI pattern (RFC 5280 profile): one self-signed CA
(``BasicConstraints ca=True, pathlen=0``, ``keyCertSign``) issues the SuperLink's server
certificate (``serverAuth``, SANs for ``localhost``, ``127.0.0.1``, ``::1`` and every
``--host``). Devices hold the CA certificate only (``flower-supernode --root-certificates``)
and so accept no other server. Keys are ECDSA P-384 (``cryptography``).

SuperNode authentication (flwr 1.42, ``--enable-supernode-auth``): each SuperNode holds an
ECDSA key on a NIST curve (P-384 here) as an OpenSSH private key
(``flower-supernode --auth-supernode-private-key``; read by ``load_ssh_private_key`` in
``flwr/supernode/cli/flower_supernode.py``); the operator registers its OpenSSH public key
on the SuperLink (``flwr supernode register``; ``load_ssh_public_key`` in
``flwr/cli/supernode/register.py``). The SuperLink then refuses every Fleet request not
signed by a registered key.

Layout written under one folder (private keys 0600, every file written atomically)::

    <out>/ca.pem  <out>/ca.key                  the CA (ca.key never leaves the operator)
    <out>/server.pem  <out>/server.key          the SuperLink's certificate and key
    <out>/supernodes/partition-<pid>/node.key   a SuperNode's private key (goes to the device)
    <out>/supernodes/partition-<pid>/node.pub   its public key (what the operator registers)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edgefuse.io import atomic_write_bytes
from edgefuse.transport.identity import MAX_DEVICES

CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
NODE_KEY, NODE_PUB = "node.key", "node.pub"
CA_DAYS = 3650
SERVER_DAYS = 397  # the longest validity public TLS clients accept for a leaf
MAX_HOSTS = 64
MAX_NODES = MAX_DEVICES  # SuperNode keys: one per device
MAX_KEY_FILE_BYTES = 1 << 16
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class DeployKeyError(ValueError):
    """A host name, count or key file is unusable, or a certificate does not verify."""


@dataclass(frozen=True)
class Certs:
    """Paths of the TLS files written by :func:`write_certs`."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


def check_host(host: str) -> x509.GeneralName:
    """The SAN entry for ``host``: an IP address, or a DNS name (labels of 1-63 letters,
    digits and inner dashes, 253 characters at most; ``*.`` wildcards refused).

    Raises :class:`DeployKeyError` for anything else."""
    if not isinstance(host, str) or not host or len(host) > 253:
        raise DeployKeyError(f"bad host {host!r:.80}: an IP address or a DNS name of 1-253 characters")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if not all(_LABEL.match(label) for label in name.split(".")):
        raise DeployKeyError(f"bad host {host!r:.80}: an IP address or a DNS name "
                             "(letters, digits, inner dashes; no wildcards)")
    return x509.DNSName(name.lower())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _read_small(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_KEY_FILE_BYTES:
        raise DeployKeyError(f"{path} is {size} bytes; a key or certificate file is at most "
                             f"{MAX_KEY_FILE_BYTES}")
    return path.read_bytes()


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate(_read_small(out / CA_CERT))
        key = serialization.load_pem_private_key(_read_small(out / CA_KEY), password=None)
    except (ValueError, TypeError) as e:
        raise DeployKeyError(f"unreadable CA in {out}: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or (
            key.public_key().public_numbers() != cert.public_key().public_numbers()):
        raise DeployKeyError(f"{out / CA_KEY} is not the key of {out / CA_CERT}")
    return cert, key


def _new_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgefuse deployment CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA384()))
    atomic_write_bytes(out / CA_KEY, _key_pem(key), mode=0o600)  # key first: a cert never lacks it
    atomic_write_bytes(out / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert, key


def write_certs(out: str | os.PathLike, hosts: list[str] | tuple[str, ...] = ()) -> Certs:
    """Make (or keep) the CA under ``out`` and issue a fresh SuperLink certificate from it.

    An existing ``ca.pem`` + ``ca.key`` are kept (devices already trust them), so running
    it again only re-issues ``server.pem`` / ``server.key``, e.g. with more ``hosts``. The
    server certificate names ``localhost``, ``127.0.0.1``, ``::1`` and each of ``hosts``
    (at most :data:`MAX_HOSTS`; see :func:`check_host`).

    Raises :class:`DeployKeyError` for a bad host, a CA whose key does not match it, or an
    unreadable CA; ``OSError`` if ``out`` cannot be written.
    """
    out = Path(out)
    hosts = list(hosts)
    if len(hosts) > MAX_HOSTS:
        raise DeployKeyError(f"at most {MAX_HOSTS} hosts, got {len(hosts)}")
    sans: list[x509.GeneralName] = []
    for h in [*DEFAULT_HOSTS, *hosts]:
        entry = check_host(h)
        if entry not in sans:
            sans.append(entry)
    out.mkdir(parents=True, exist_ok=True)
    have = [(out / f).exists() for f in (CA_CERT, CA_KEY)]
    if all(have):
        ca_cert, ca_key = _load_ca(out)
    elif any(have):
        raise DeployKeyError(f"{out} holds only one of {CA_CERT} and {CA_KEY}: restore the other "
                             "or remove both to make a new CA (devices must then get the new one)")
    else:
        ca_cert, ca_key = _new_ca(out)
    key = ec.generate_private_key(ec.SECP384R1())
    first = next((h for h in hosts), "localhost")
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, first)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=SERVER_DAYS), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    atomic_write_bytes(out / SERVER_KEY, _key_pem(key), mode=0o600)
    atomic_write_bytes(out / SERVER_CERT, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return Certs(out / CA_CERT, out / CA_KEY, out / SERVER_CERT, out / SERVER_KEY)


def verify_server_cert(ca_pem: bytes, cert_pem: bytes, host: str) -> x509.Certificate:
    """Check that ``cert_pem`` is a server certificate for ``host`` issued by the CA in
    ``ca_pem`` and valid now (``cryptography``'s RFC 5280 path validation).

    Returns the certificate; raises :class:`DeployKeyError` if it does not verify."""
    from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = check_host(host)
        subject = (x509.verification.IPAddress(san.value) if isinstance(san, x509.IPAddress)
                   else x509.DNSName(san.value))
        verifier = PolicyBuilder().store(Store([ca])).time(_now()).build_server_verifier(subject)
        verifier.verify(cert, [])
    except (VerificationError, InvalidSignature, ValueError) as e:
        raise DeployKeyError(f"the server certificate does not verify for {host!r}: {e}") from None
    return cert


def node_dir(out: str | os.PathLike, partition_id: int) -> Path:
    """Where :func:`write_supernode_keys` keeps SuperNode ``partition_id``'s key pair."""
    pid = int(partition_id)
    if not 0 <= pid < MAX_NODES:
        raise DeployKeyError(f"a partition id is in [0, {MAX_NODES}), got {pid}")
    return Path(out) / "supernodes" / f"partition-{pid}"


def load_supernode_key(path: str | os.PathLike) -> ec.EllipticCurvePrivateKey:
    """A SuperNode private key as ``flower-supernode`` reads it (OpenSSH, ECDSA, NIST curve).

    Raises :class:`DeployKeyError` for a file that is not one."""
    path = Path(path)
    try:
        key = serialization.load_ssh_private_key(_read_small(path), password=None)
    except (ValueError, TypeError) as e:
        raise DeployKeyError(f"{path} is not an OpenSSH private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in (
            "secp256r1", "secp384r1", "secp521r1"):
        raise DeployKeyError(f"{path} is not an ECDSA key on a NIST curve (flwr 1.42 needs one)")
    return key


def write_supernode_keys(out: str | os.PathLike, num_nodes: int) -> list[Path]:
    """Make (or keep) one SuperNode key pair per partition id in ``[0, num_nodes)``.

    ``node.key``: ECDSA P-384 private key, OpenSSH PEM, 0600; ``node.pub``: its OpenSSH
    public key line (what ``flwr supernode register`` takes). An existing valid pair is
    kept; a ``node.pub`` that does not match its ``node.key`` is rewritten from the key.
    Returns the node folders. Raises :class:`DeployKeyError` for ``num_nodes`` outside
    ``[1, MAX_NODES]`` or an existing ``node.key`` that is not a usable key.
    """
    n = int(num_nodes)
    if not 1 <= n <= MAX_NODES:
        raise DeployKeyError(f"the number of SuperNodes is in [1, {MAX_NODES}], got {n}")
    folders = []
    for pid in range(n):
        d = node_dir(out, pid)
        if (d / NODE_KEY).exists():
            key = load_supernode_key(d / NODE_KEY)
        else:
            key = ec.generate_private_key(ec.SECP384R1())
            atomic_write_bytes(d / NODE_KEY, key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption()), mode=0o600)
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                            serialization.PublicFormat.OpenSSH)
        pub += f" edgefuse-partition-{pid}\n".encode()
        if not (d / NODE_PUB).exists() or (d / NODE_PUB).read_bytes() != pub:
            atomic_write_bytes(d / NODE_PUB, pub, mode=0o644)
        folders.append(d)
    return folders


def main(argv: list[str]) -> int:
    """``edgefuse deploy certs|supernode-keys ...``; errors as :class:`CLIError` (one line)."""
    from edgefuse.cli.common import CLIError, Parser

    parser = Parser(prog="edgefuse deploy")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("certs", help="a CA (kept if present) and a fresh SuperLink TLS certificate")
    c.add_argument("--out", required=True, help="folder for ca.pem, ca.key, server.pem, server.key")
    c.add_argument("--host", action="append", default=[],
                   help="a name or IP devices use to reach the SuperLink (repeatable; "
                        "localhost, 127.0.0.1 and ::1 are always in)")
    k = sub.add_parser("supernode-keys", help="one SuperNode authentication key pair per partition id")
    k.add_argument("--out", required=True, help="folder; pairs go to supernodes/partition-<pid>/")
    k.add_argument("--nodes", type=int, required=True, help="number of SuperNodes (partition ids 0..N-1)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "certs":
            certs = write_certs(args.out, args.host)
            sans = certs.server_cert.read_bytes()
            cert = x509.load_pem_x509_certificate(sans)
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            print(f"CA: {certs.ca_cert} (keep {certs.ca_key} on this machine)")
            print(f"SuperLink: {certs.server_cert} {certs.server_key} for "
                  + ", ".join(str(g.value) for g in names))
        else:
            for d in write_supernode_keys(args.out, args.nodes):
                print(f"{d / NODE_KEY} (to the device)  {d / NODE_PUB} (flwr supernode register)")
    except (DeployKeyError, OSError) as e:
        raise CLIError(e) from None
    return 0
