"""`open_channel`: the one way a spindle service opens a gRPC channel to another (plaintext or mutual TLS).

Every internal client (frontend -> scheduler, scheduler -> workers) goes through here, so
channel options and transport security are decided in one place.
"""

from __future__ import annotations

import grpc

from shared.grpc_server import GRPC_OPTIONS
from shared.tls import TlsFiles, grpc_channel_credentials


def open_channel(address: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """A channel to `address`; with `tls`, it presents our certificate and verifies the server's.

    NOTE: the server's certificate must name the host part of `address` (a DNS or IP
    subject alternative name), as for any TLS client.
    """
    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.aio.secure_channel(address, grpc_channel_credentials(tls), options=GRPC_OPTIONS)
