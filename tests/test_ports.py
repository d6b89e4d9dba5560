"""common.ports: harness ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from common import ports


def test_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    if low > 11000:
        assert all(10000 <= p < low for p in got)
    with socket.socket() as s:  # still free: a server can bind it
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_in_use_is_skipped(monkeypatch):
    taken = socket.socket()
    for candidate in range(10500, 11000):  # one not handed out, held by a listener
        try:
            taken.bind(("127.0.0.1", candidate))
            break
        except OSError:
            continue
    taken.listen()
    try:
        held = taken.getsockname()[1]
        assert held not in ports._HANDED_OUT
        seq = iter([held, held])
        real = ports._PORT_RNG.randrange
        monkeypatch.setattr(ports._PORT_RNG, "randrange", lambda a, b: next(seq, None) or real(a, b))
        assert ports.free_port() != held
        assert next(seq, None) is None  # both draws of the held port were tried and refused
    finally:
        taken.close()
