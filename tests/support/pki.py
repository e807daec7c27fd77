"""Certificates made on the fly for TLS tests: one CA, a broker certificate, per-device ones.

``make_pki(dir, ["dev-a", "dev-b"])`` writes PEM files and returns their paths; a device's
certificate has its id as CN, which mosquitto's ``use_identity_as_username`` turns into the
username its ACL patterns (``%u``) see. EC P-256 keys: fast to make, small.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pki:
    dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    """CN -> (cert, key)."""

    def client(self, cn: str) -> tuple[Path, Path]:
        if cn not in self.clients:
            self.clients[cn] = _issue(self, cn, server=False)
        return self.clients[cn]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    path.chmod(0o600)


def _issue(pki: Pki, cn: str, *, server: bool, ca: tuple[Path, Path] | None = None) -> tuple[
    Path, Path
]:
    ca_cert_path, ca_key_path = ca or (pki.ca_cert, pki.ca_key)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
        ), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    cert_path, key_path = pki.dir / f"{cn}.crt", pki.dir / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


def _make_ca(dir: Path, cn: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dir / f"{cn}.crt", dir / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


def make_pki(dir: Path, clients: list[str] = ()) -> Pki:  # type: ignore[assignment]
    """A CA, a broker certificate for localhost/127.0.0.1, and one certificate per client CN."""
    dir.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _make_ca(dir, "edgetrain-test-ca")
    pki = Pki(dir, ca_cert, ca_key, ca_cert, ca_key)
    pki.server_cert, pki.server_key = _issue(pki, "broker", server=True)
    for cn in clients:
        pki.client(cn)
    return pki


def make_rogue_client(dir: Path, cn: str) -> tuple[Path, Path]:
    """A client certificate for ``cn`` signed by a different CA: the broker must refuse it."""
    dir = dir / "rogue"
    dir.mkdir(parents=True, exist_ok=True)
    rogue_ca = _make_ca(dir, "rogue-ca")
    tmp = Pki(dir, *rogue_ca, *rogue_ca)
    return _issue(tmp, cn, server=False, ca=rogue_ca)
