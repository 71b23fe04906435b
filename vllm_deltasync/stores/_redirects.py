"""The redirect rule of the hf:// store, and the address pins it is checked by.

A redirect (the resolve call's 302 to a signed CDN URL, or one the CDN answers) is followed
only where the rule allows it (docs/transports.md): never from a public origin to a private,
loopback or link-local address; same class and public targets allowed; more by
``HfOptions.allow_redirects_to``. A host name is looked up once per :data:`PIN_TTL_S`, and the
requests to it connect to the addresses that check was made on (``Host`` header and TLS server
name kept), so a name that changes its answer between the check and the connection (DNS
rebinding) is never followed there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from vllm_deltasync._urls import address_class, redirect_allowed
from vllm_deltasync.errors import StoreError, TransientStoreError

PIN_TTL_S = 300.0
"""Seconds the address check of a redirect host (and the addresses it pins) is reused; a
CDN's addresses change over hours, a rebinding attacker's between two lookups."""


@dataclass(frozen=True)
class Pin:
    cls: str | None
    """Address class of the host (the least public of its addresses); None: unresolvable."""
    addresses: tuple[str, ...]
    """The addresses the class was judged by: the only ones a request to the host uses."""
    until: float
    """monotonic time the check expires."""


def is_name(host: str) -> bool:
    """True for a host name (looked up), False for an IP literal."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return True
    return False


class RedirectGuard:
    """Checks redirects of one store against the rule and pins the hosts it allowed.

    ``endpoint``: the store's own origin (its URLs go as they are); ``allow``: the address
    classes ``allow_redirects_to`` adds; ``on_refused``: counts a refusal (the store's stats).
    """

    def __init__(self, endpoint: str, allow: tuple[str, ...],
                 on_refused: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.allow = allow
        self._on_refused = on_refused
        self.pins: dict[str, Pin] = {}
        """host -> its address class and the addresses it was judged by."""

    async def lookup(self, host: str) -> Pin:
        """The address class of ``host`` and the addresses it was judged by, looked up once
        per :data:`PIN_TTL_S` (an IP literal is its own address). Requests to a checked host
        connect to these addresses (:meth:`pinned`): the host name is never looked up again
        between the check and the connection (no DNS rebinding)."""
        now = time.monotonic()
        pin = self.pins.get(host)
        if pin is not None and pin.until > now:
            return pin
        literal = address_class(host)
        if literal is not None and not is_name(host):
            pin = Pin(literal, (), now + PIN_TTL_S)
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, None, type=socket.SOCK_STREAM)
            except OSError:
                infos = []  # unresolvable: refused by the check (no second lookup later)
            addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
            classes = {address_class(a) for a in addresses} | ({literal} if literal else set())
            found = None
            # the least public class wins: one private address makes the host private
            for kind in ("link-local", "loopback", "private", "public"):
                if kind in classes:
                    found = kind
                    break
            pin = Pin(found, addresses, now + PIN_TTL_S)
        if len(self.pins) >= 1024:
            self.pins.clear()
        self.pins[host] = pin
        return pin

    async def host_class(self, url: str) -> str | None:
        """The address class of ``url``'s host (resolved when it is a name; pinned)."""
        return (await self.lookup(urlsplit(url).hostname or "")).cls

    async def check(self, origin: str, target: str, what: str) -> None:
        """The redirect rule for ``origin`` -> ``target``. A refused redirect is a StoreError
        (not retried); a target host that does not resolve is a TransientStoreError (nothing
        is sent to it)."""
        if urlsplit(target).scheme not in ("http", "https"):
            raise StoreError(f"{what}: redirected to a non-HTTP URL; refused")
        origin_class = await self.host_class(origin) or "public"
        target_class = await self.host_class(target)
        if target_class is None:
            self.pins.pop(urlsplit(target).hostname or "", None)  # look it up again next time
            raise TransientStoreError(
                f"{what}: redirected to {urlsplit(target).hostname}, which does not resolve")
        if not redirect_allowed(origin_class, target_class, self.allow):
            self._on_refused()
            raise StoreError(
                f"{what}: a {origin_class} origin redirected to a {target_class} address "
                f"({urlsplit(target).hostname}); refused (HfOptions.allow_redirects_to allows it)"
            )

    async def pinned(self, url: str, what: str) -> tuple[URL, dict[str, Any]]:
        """Where to connect for ``url``: a redirect target's host name replaced by the
        address its check was made on (``Host`` header and TLS server name kept), so the
        name is not looked up a second time. The endpoint's own URLs go as they are; a target
        whose check is older than :data:`PIN_TTL_S` is checked again first."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if not is_name(host) or parts[:2] == urlsplit(self.endpoint)[:2]:
            return URL(url, encoded=True), {}
        pin = self.pins.get(host)
        if pin is None or pin.until <= time.monotonic() or not pin.addresses:
            await self.check(self.endpoint, url, what)
            pin = self.pins[host]
        address = pin.addresses[0]
        shown = f"[{address}]" if ":" in address else address
        netloc = shown if parts.port is None else f"{shown}:{parts.port}"
        direct = parts._replace(netloc=netloc).geturl()
        host_header = host if parts.port is None else f"{host}:{parts.port}"
        extra: dict[str, Any] = {"host_header": host_header}
        if parts.scheme == "https":
            extra["server_hostname"] = host  # SNI and certificate checked against the name
        return URL(direct, encoded=True), extra


__all__ = ["PIN_TTL_S", "Pin", "RedirectGuard", "is_name"]
