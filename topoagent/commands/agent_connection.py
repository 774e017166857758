"""One HTTP exchange with one agent, every step of it (connecting, the TLS handshake, the
answer's head and its body) within one deadline.

A socket timeout alone bounds each receive, not the exchange: an agent that sends one
header line a second would hold its reader as long as it liked.  Here every receive waits
at most for the time left, so the deadline holds however the answer trickles in, and no
thread is left blocked past it.  Only the name look-up (getaddrinfo) is not bounded: an
address given as an IP needs none.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from typing import Any


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


class _DeadlineSocket(socket.socket):
    """A socket whose every receive waits at most until ``deadline``: a socket timeout
    alone bounds each receive, so an agent sending one header line a second would hold
    the command for as long as it liked."""

    deadline = 0.0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self.settimeout(_time_left(self.deadline))
        return super().recv(bufsize, flags)


class _DeadlineTLSSocket(ssl.SSLSocket):
    """The same over TLS (the TLS handshake itself is bounded by the timeout set before it)."""

    deadline = 0.0

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_time_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        self.settimeout(_time_left(self.deadline))
        return super().recv(buflen, flags)


class AgentConnection(http.client.HTTPConnection):
    """One GET to one agent, every step of it within ``deadline``."""

    def __init__(self, netloc: str, deadline: float, tls: bool) -> None:
        self.default_port = 443 if tls else 80  # read by the parent's host:port parsing
        super().__init__(netloc)
        self.deadline, self.tls = deadline, tls
        self.reached = False  # the TCP connection was taken: from here a silence is the peer's, not a missing peer


    def connect(self) -> None:
        failure: OSError | None = None
        for family, kind, proto, _, address in socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(_time_left(self.deadline))
                sock.connect(address)
                self.reached = True
                break
            except OSError as exc:  # TimeoutError included: the next address has no time left either
                sock.close()
                failure = exc
                if isinstance(exc, TimeoutError):
                    raise
        else:
            raise failure or OSError(f"{self.host}: no address")
        if self.tls:
            context = ssl.create_default_context()
            context.sslsocket_class = _DeadlineTLSSocket
            sock.settimeout(_time_left(self.deadline))
            tls = context.wrap_socket(sock, server_hostname=self.host, do_handshake_on_connect=False)
            assert isinstance(tls, _DeadlineTLSSocket)
            tls.deadline = self.deadline
            tls.do_handshake()
            self.sock = tls
        else:
            plain = _DeadlineSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
            plain.deadline = self.deadline
            self.sock = plain


__all__ = ["AgentConnection"]
