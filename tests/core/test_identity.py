"""Identities and pinned trust (edgefuse.transport.identity): signatures, pins, provisioning."""

import json
import os

import pytest

from edgefuse.transport.identity import (CLOUD, AUTHORIZED_FILE, IDENTITY_FILE, TRUST_FILE, Identity,
                                         IdentityError, TrustStore, UntrustedPeerError, cloud_dir,
                                         device_dir, device_name, fingerprint, load_identity,
                                         provision, safety_number, verify_signature)


def test_signature_verifies_and_forgery_is_refused():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"ephemeral key")
    verify_signature(a.public_bytes(), sig, b"ephemeral key")
    with pytest.raises(IdentityError, match="does not verify"):
        verify_signature(a.public_bytes(), sig, b"ephemeral kez")  # altered message
    with pytest.raises(IdentityError, match="does not verify"):
        verify_signature(b.public_bytes(), sig, b"ephemeral key")  # someone else's key
    with pytest.raises(IdentityError, match="64 bytes"):
        verify_signature(a.public_bytes(), sig[:-1], b"ephemeral key")


def test_save_load_round_trip_is_private(tmp_path):
    ident = Identity.generate()
    path = ident.save(tmp_path / "k" / IDENTITY_FILE)
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = load_identity(path)
    assert again.public_bytes() == ident.public_bytes()
    assert b"PRIVATE" not in repr(again).encode() and again.fingerprint in repr(again)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        load_identity(path)
    with pytest.raises(IdentityError, match="no identity key"):
        load_identity(tmp_path / "absent.key")


def test_pins_refuse_a_swapped_key(tmp_path):
    real, attacker = Identity.generate(), Identity.generate()
    store = TrustStore.load(tmp_path / TRUST_FILE)
    assert store.names() == []
    store.pin(CLOUD, real.public_bytes())
    store.save()
    store = TrustStore.load(tmp_path / TRUST_FILE)
    store.check(CLOUD, real.public_bytes())
    with pytest.raises(UntrustedPeerError, match="swapped"):
        store.check(CLOUD, attacker.public_bytes())
    with pytest.raises(UntrustedPeerError, match="already pinned"):
        store.pin(CLOUD, attacker.public_bytes())
    with pytest.raises(UntrustedPeerError, match="no key is pinned"):
        store.get("device-9")
    assert store.find(real.public_bytes()) == CLOUD and store.find(attacker.public_bytes()) is None


@pytest.mark.parametrize("doc", [{"version": 2, "pins": {}}, {"version": 1, "pins": {"../x": "00" * 32}},
                                 {"version": 1, "pins": {"cloud": "00" * 31}}, [1, 2]])
def test_malformed_trust_store_is_refused(tmp_path, doc):
    (tmp_path / TRUST_FILE).write_text(json.dumps(doc))
    with pytest.raises(IdentityError, match="malformed"):
        TrustStore.load(tmp_path / TRUST_FILE)


def test_fingerprint_and_safety_number_shapes():
    a, b = Identity.generate(), Identity.generate()
    fp = fingerprint(a.public_bytes())
    assert len(fp.split()) == 8 and all(len(g) == 4 for g in fp.split())
    sn = safety_number(a.public_bytes(), b.public_bytes())
    assert sn == safety_number(b.public_bytes(), a.public_bytes())  # same number at both ends
    assert len(sn.split()) == 12 and sn.replace(" ", "").isdigit()
    assert sn != safety_number(a.public_bytes(), Identity.generate().public_bytes())


def test_provision_pins_everyone_and_is_idempotent(tmp_path):
    first = provision(tmp_path, 3)
    assert set(first) == {CLOUD, "device-0", "device-1", "device-2"}
    assert provision(tmp_path, 3) == first  # keys are kept
    cloud = load_identity(cloud_dir(tmp_path) / IDENTITY_FILE)
    authorized = TrustStore.load(cloud_dir(tmp_path) / AUTHORIZED_FILE)
    assert authorized.names() == ["device-0", "device-1", "device-2"]
    for pid in range(3):
        me = load_identity(device_dir(tmp_path, pid) / IDENTITY_FILE)
        authorized.check(device_name(pid), me.public_bytes())
        trust = TrustStore.load(device_dir(tmp_path, pid) / TRUST_FILE)
        trust.check(CLOUD, cloud.public_bytes())
        assert trust.names() == [CLOUD, "device-0", "device-1", "device-2"]
    with pytest.raises(IdentityError):
        device_name(-1)


def test_a_device_made_key_is_pinned_and_never_made_by_the_operator(tmp_path):
    """The device keeps its private key; the operator registers only the public part."""
    from edgefuse.transport.identity import PUBLIC_FILE, register_public

    own = load_identity(tmp_path / "on-device" / IDENTITY_FILE, create=True)  # on the device
    register_public(tmp_path / "ops", 1, own.public_bytes())  # the operator's machine
    prints = provision(tmp_path / "ops", 2)
    assert prints["device-1"] == own.fingerprint
    assert not (device_dir(tmp_path / "ops", 1) / IDENTITY_FILE).exists()  # no key made for it
    assert (device_dir(tmp_path / "ops", 0) / IDENTITY_FILE).exists()  # the other one: operator-made
    TrustStore.load(cloud_dir(tmp_path / "ops") / AUTHORIZED_FILE).check("device-1", own.public_bytes())
    TrustStore.load(device_dir(tmp_path / "ops", 0) / TRUST_FILE).check("device-1", own.public_bytes())
    # an operator-held key for the device with another public key is not silently replaced
    with pytest.raises(IdentityError, match="holds another key"):
        register_public(tmp_path / "ops", 0, own.public_bytes())
    (device_dir(tmp_path / "ops", 1) / PUBLIC_FILE).write_text("zz" * 32)
    with pytest.raises(IdentityError, match="not a 64-hex"):
        provision(tmp_path / "ops", 2)
