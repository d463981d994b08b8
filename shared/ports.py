"""Free loopback ports for a server that binds them a moment later, chosen outside the ephemeral range.

Why: `bind(port 0)` hands out a port from the kernel's ephemeral range, the range it also draws
every outgoing connection's local port from. Between choosing such a port and the server binding
it (seconds, while a model loads), any outgoing connection may take it: a CI run saw a frontend
fail with "address already in use" on a port chosen that way. Ports below the ephemeral range
(or above it) are never given to outgoing connections, so only another server could take them.
No torch here: the launcher imports this.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST_PORT = 10000  # below: well-known and registered services
_MIN_CHOICES = 1000  # a side of the ephemeral range narrower than this is not used
_ATTEMPTS = 200
_random = random.Random()  # seeded from the OS: processes choosing at the same time rarely agree


def ephemeral_range() -> tuple[int, int]:
    """(lowest, highest) local port the kernel gives outgoing connections."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):  # not Linux, or no /proc
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` on `host` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of `count` consecutive ports on `host` that are free now and outside the ephemeral range.

    Falls back to the kernel's choice (inside the range) where the host leaves no room outside it.
    """
    low, high = ephemeral_range()
    sides = [side for side in (range(LOWEST_PORT, low - count + 1), range(high + 1, 65536 - count + 1))
             if len(side) >= _MIN_CHOICES]
    for _ in range(_ATTEMPTS if sides else 0):
        base = _random.choice(_random.choice(sides))
        if all(is_free(port, host) for port in range(base, base + count)):
            return base
    for _ in range(_ATTEMPTS):
        with socket.socket() as sock:
            sock.bind((host, 0))
            base = sock.getsockname()[1]
        if base + count <= 65536 and all(is_free(port, host) for port in range(base, base + count)):
            return base
    raise OSError(f"no run of {count} free ports on {host}")


def distinct_free_ports(count: int, exclude: frozenset[int] = frozenset(), host: str = "127.0.0.1") -> list[int]:
    """`count` different free ports, none in `exclude` (ports already promised to other servers,
    which are free now only because those servers have not bound them yet)."""
    chosen: list[int] = []
    for _ in range(_ATTEMPTS):
        if len(chosen) == count:
            break
        port = free_port(host)
        if port not in exclude and port not in chosen:
            chosen.append(port)
    if len(chosen) < count:
        raise OSError(f"no {count} distinct free ports on {host}")
    return chosen
