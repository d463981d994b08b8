"""TLS from PEM files: which files, checked once at start-up, in the forms aiohttp and gRPC take.

Public ports use a certificate and key; the internal links (frontend -> scheduler -> workers)
use mutual TLS, where the CA file both verifies the peer's certificate and, on a server,
makes a client certificate mandatory. Files are read when a server or channel is built.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import grpc

PUBLIC_TLS_FLAGS = "--tls"
INTERNAL_TLS_FLAGS = "--internal-tls"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Paths of one TLS identity; every given file must exist.

    Attributes:
        cert_file: PEM certificate chain presented to peers.
        key_file: PEM private key of that certificate.
        ca_file: PEM CA bundle that peers' certificates must chain to; empty: a server asks
            no client certificate and a client trusts the system's roots.
        flags: prefix of the flags the paths came from (`--tls`, `--internal-tls`), so an
            error names the flag an operator has to fix.
    """

    cert_file: str
    key_file: str
    ca_file: str = ""
    flags: str = PUBLIC_TLS_FLAGS

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if (path or name != "ca_file") and not os.path.isfile(path):
                raise ValueError(f"{_flag(self.flags, name)}={path!r} is not a file")

    @classmethod
    def from_flags(cls, flags: str, cert_file: str, key_file: str, ca_file: str | None = None) -> TlsFiles | None:
        """None when no flag of the group is set; a ValueError naming the missing ones when only some are.

        `ca_file=None` means the group has no CA flag (public TLS); a string, even empty,
        means it has one and it is required (mutual TLS).
        """
        given = {"cert_file": cert_file, "key_file": key_file}
        if ca_file is not None:
            given["ca_file"] = ca_file
        if not any(given.values()):
            return None
        missing = [_flag(flags, name) for name, value in given.items() if not value]
        if missing:
            group = ", ".join(_flag(flags, name) for name in given)
            raise ValueError(f"{', '.join(missing)} missing: {group} go together")
        return cls(cert_file, key_file, ca_file or "", flags)

    @property
    def is_mutual(self) -> bool:
        return bool(self.ca_file)

    def read_ca(self) -> bytes | None:
        return _read(self.ca_file) if self.ca_file else None


def _flag(flags: str, name: str) -> str:
    """The flag a field comes from: (`--internal-tls`, `ca_file`) -> `--internal-tls-ca-file`."""
    return f"{flags}-{name.replace('_', '-')}"


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def server_ssl_context(tls: TlsFiles | None) -> ssl.SSLContext | None:
    """An SSLContext for an HTTPS server (client certificates required when a CA is given); None: plaintext."""
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca_file or None)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.is_mutual:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_server_credentials(tls: TlsFiles | None) -> grpc.ServerCredentials | None:
    """Credentials for a gRPC server; with a CA, clients without a certificate it signed are refused.

    None (plaintext) for None, so a service passes its optional TLS setting straight through.
    """
    if tls is None:
        return None
    return grpc.ssl_server_credentials([(_read(tls.key_file), _read(tls.cert_file))],
                                       root_certificates=tls.read_ca(), require_client_auth=tls.is_mutual)


def grpc_channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Credentials for a gRPC client: present our certificate, verify the server's against the CA."""
    return grpc.ssl_channel_credentials(root_certificates=tls.read_ca(), private_key=_read(tls.key_file),
                                        certificate_chain=_read(tls.cert_file))
