"""Loopback ports for child servers: injected — many asks in a row (the kernel hands a just-released
port out again: 1,000 plain bind-to-0 asks repeat one every time here); must happen — no port is handed
out twice while it is remembered, and every port handed out can be bound."""

from __future__ import annotations

import socket

import pytest

from semkv.processes import LoopbackPorts, free_port


def test_free_port_never_repeats_within_a_process():
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_a_port_handed_out_can_be_bound():
    port = LoopbackPorts().take()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_only_the_last_ports_are_remembered():
    ports = LoopbackPorts(memory=3)
    taken = [ports.take() for _ in range(5)]
    assert len(set(taken)) == 5
    assert ports.remembered == tuple(taken[-3:])


def test_bad_memory_is_refused():
    with pytest.raises(ValueError, match="memory"):
        LoopbackPorts(memory=0)
