"""Loopback ports for servers that a harness (the tests, the benchmarks)
starts later, as separate processes."""

from __future__ import annotations

import os
import random
import socket

_HANDED_OUT: set[int] = set()
_PORT_RNG = random.Random(os.getpid())


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port for a server started later. It lies below the
    kernel's ephemeral range, so no outgoing connection can take it between
    this check and the server's bind (a port from bind(0) could be), and it
    is never handed out twice in one run."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORT_RNG.randrange(10000, low) if low > 11000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")
