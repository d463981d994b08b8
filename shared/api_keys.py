"""API keys: loaded from a file or the environment, kept only as SHA-256 digests, checked in constant time.

The one place that knows what a valid key is; the HTTP middleware and the gRPC interceptor only
pass it the presented credentials. Never stores, logs or returns a key in clear; imports
neither grpc nor aiohttp.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HASHED_PREFIX = "sha256:"
# Hex digits of a key's digest that name it (in logs, and for per-key rate limits): enough to
# tell keys apart, far too few to help anyone guess one.
KEY_ID_HEX_DIGITS = 16
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def key_digest(key: str) -> bytes:
    """SHA-256 of a key; `surrogatepass` so a header that is not valid Unicode still hashes (to no match)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id(digest: bytes) -> str:
    """The identity of a key: its digest's prefix, the same whether the key was given hashed or not."""
    return digest.hex()[:KEY_ID_HEX_DIGITS]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The accepted keys, as digests; empty means authentication is off.

    Attributes:
        digests: SHA-256 of every accepted key (never the keys themselves).
    """

    digests: tuple[bytes, ...] = ()

    @classmethod
    def from_keys(cls, keys: Iterable[str]) -> ApiKeys:
        return cls(tuple(key_digest(key) for key in keys))

    @classmethod
    def load(cls, file: str = "", env_keys: str = "") -> ApiKeys:
        """Keys from `--api-key-file` (one per line) and `SPINDLE_API_KEYS` (comma-separated).

        In the file, blank lines and lines starting with `#` are skipped and `sha256:<hex>`
        is a key already hashed, so the file need not hold any key in clear. A file that
        names no key is an error: silently serving without authentication would be worse.
        """
        digests = [key_digest(key) for key in (k.strip() for k in env_keys.split(",")) if key]
        if file:
            from_file = _read_key_file(Path(file))
            if not from_file:
                raise ValueError(f"--api-key-file={file!r} holds no key")
            digests += from_file
        return cls(tuple(digests))

    @property
    def is_enabled(self) -> bool:
        return bool(self.digests)

    def check(self, key: str) -> str | None:
        """The key's id if it is accepted, else None.

        NOTE: compares against every digest without stopping at a match, each comparison in
        constant time, so the time taken says nothing about which key (or how much of one)
        matched.
        """
        presented = key_digest(key)
        matched = b""
        for digest in self.digests:
            if hmac.compare_digest(digest, presented):
                matched = digest
        return key_id(matched) if matched and key else None  # an empty key never passes

    def check_authorization(self, authorization: str) -> str | None:
        """The key id for an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata), else None."""
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.check(credentials.strip())

    def __repr__(self) -> str:  # digests stay out of logs and tracebacks too
        return f"ApiKeys(num_keys={len(self.digests)})"


def _read_key_file(path: Path) -> list[bytes]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--api-key-file={str(path)!r} cannot be read: {exc.strerror}") from None
    digests = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(HASHED_PREFIX):
            hex_digest = line.removeprefix(HASHED_PREFIX).strip().lower()
            if not _HEX_DIGEST.fullmatch(hex_digest):
                # The line itself stays out of the message: it may be a key pasted by mistake.
                raise ValueError(f"--api-key-file={str(path)!r} line {number}: {HASHED_PREFIX} must be followed "
                                 "by 64 hex digits")
            digests.append(bytes.fromhex(hex_digest))
        else:
            digests.append(key_digest(line))
    return digests
