"""The rendezvous port is drawn where outgoing connections cannot take it before the group binds."""

import socket

from asyncrl.sync.wire import PORT_FLOOR, ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    low = ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert all(PORT_FLOOR <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 1  # drawn, not a fixed port that concurrent runs would share
    with socket.create_server(("127.0.0.1", ports[0])):
        pass


def test_a_taken_port_is_never_returned(monkeypatch):
    """Draws that land on a taken port are drawn again (the last draw, 0, lets the kernel choose)."""
    held = socket.create_server(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    draws = iter([taken, taken, 0])

    class Fixed:
        def randrange(self, a, b):
            return next(draws)

    monkeypatch.setattr("asyncrl.sync.wire.random.Random", Fixed)
    try:
        port = free_port()
    finally:
        held.close()
    assert port != taken and port > 0
