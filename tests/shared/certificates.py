"""A throwaway PKI for TLS tests: a CA and certificates it signs, written as PEM files (`cryptography`).

Every certificate names `localhost` and `127.0.0.1` and may serve as server or client, so one
issued identity fits both ends of a loopback connection.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.tls import INTERNAL_TLS_FLAGS, TlsFiles

_VALIDITY = datetime.timedelta(days=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA in `directory`; `issue` signs leaf certificates with it."""

    directory: Path
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @classmethod
    def create(cls, directory: Path, name: str = "spindle-test-ca") -> CertificateAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256())
        )
        (directory / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return cls(directory, name, key, certificate)

    @property
    def ca_file(self) -> Path:
        return self.directory / f"{self.name}.pem"

    def issue(self, common_name: str) -> tuple[Path, Path]:
        """A certificate for `common_name` (valid for localhost and 127.0.0.1) and its key: (cert, key) files."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        certificate = (
            x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.certificate.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        cert_file = self.directory / f"{common_name}.crt"
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return cert_file, _write_key(key, self.directory / f"{common_name}.key")

    def public_tls(self, common_name: str) -> TlsFiles:
        """A server identity for the public ports (no client certificates asked)."""
        cert_file, key_file = self.issue(common_name)
        return TlsFiles(str(cert_file), str(key_file))

    def internal_tls(self, common_name: str) -> TlsFiles:
        """An identity for mutual TLS between services: presents a certificate, trusts only this CA."""
        cert_file, key_file = self.issue(common_name)
        return TlsFiles(str(cert_file), str(key_file), str(self.ca_file), INTERNAL_TLS_FLAGS)
