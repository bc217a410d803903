"""`python -m router --fd N` serves a listening socket its parent handed down
(router/http/server.py `inherited_listener`); a descriptor that is not one is refused with an error
naming `--fd`. The handover under `fleet up`: tests/integration/test_router_socket_handover.py."""

from __future__ import annotations

import os
import socket

import pytest

from router.http.server import inherited_listener


def test_a_listening_socket_is_taken_with_its_own_family_and_port():
    with socket.create_server(("127.0.0.1", 0)) as parent:
        child = inherited_listener(os.dup(parent.fileno()))
        try:
            assert child.family == socket.AF_INET and child.getsockname() == parent.getsockname()
        finally:
            child.close()


def test_the_router_refuses_a_descriptor_that_is_not_a_listening_socket():
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match=f"--fd {r}: not"):
            inherited_listener(r)
    finally:
        os.close(r)
        os.close(w)
    with socket.socket() as unbound:
        fd = unbound.fileno()
        with pytest.raises(ValueError, match="not a listening TCP socket"):
            inherited_listener(fd)
        assert unbound.fileno() == fd   # left open for its owner
