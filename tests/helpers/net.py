"""Loopback ports and plain HTTP reads for the tests' own servers and vLLM's."""

from __future__ import annotations

import random
import socket
import urllib.error
import urllib.request
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()


def free_port(n: int = 1) -> int:
    """A loopback port p with p..p+n-1 free right now, picked below the kernel's ephemeral
    range. vLLM and every client bind their own ports from that range (port 0), so one of them
    can take a port picked there between the pick and our server's bind; a metrics port once was
    taken so in CI ("Address already in use"), and a data-parallel metrics range once more.
    Falls back to the ephemeral range if no run of n ports is free below."""
    rng = random.Random()
    top = max(_EPHEMERAL_LOW, 20100) - n
    for _ in range(200):
        base = rng.randrange(20000, top) if top > 20000 else rng.randrange(1024, 65536 - n)
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError(f"no run of {n} free loopback ports")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET (error statuses are returned, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
