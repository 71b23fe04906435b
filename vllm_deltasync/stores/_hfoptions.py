"""``HfOptions``: how an ``hf://`` store reaches its bucket (one frozen object, every field
also a ``store_options`` key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync._urls import ADDRESS_CLASSES
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores import _options
from vllm_deltasync.stores._retry import RetryPolicy

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True, kw_only=True)
class HfOptions:
    """How an :class:`HfStore` reaches its bucket. Every field is also a ``store_options`` key.

    The token is kept out of ``repr``. ``retry_policy`` also accepts None (the defaults) or a
    mapping of :class:`RetryPolicy` fields, and is always a :class:`RetryPolicy` afterwards.
    Runtime objects (an aiohttp ``session``, the ``uploader`` seam, ``environ``) are not
    options: they are keyword arguments of :class:`HfStore` (and ``store_options`` keys too).
    """

    endpoint: str | None = None
    """Hub host; None: ``HF_ENDPOINT``, else ``https://huggingface.co``."""
    token: str | bool | None = field(default=None, repr=False)
    """None or True: ``HF_TOKEN``, else huggingface_hub's chain; False: send none."""
    part_size: int = 16 << 20
    """Objects larger than one part are read as parallel ranges of this many bytes."""
    max_parallel_parts: int = 8
    request_timeout_s: float | None = 60.0
    """Longest silence on a socket before the read is retried (None: no limit)."""
    min_bytes_per_s: int | None = 64 << 10
    """A download slower than this over ``rate_window_s`` is cut and the rest retried (a body
    trickling in never holds a step forever); None: no minimum."""
    rate_window_s: float = 30.0
    max_request_s: float | None = 900.0
    """Cap on one request, however fast (a part of ``part_size`` bytes, a listing page)."""
    max_redirects: int = 10
    """Longest redirect chain followed (the resolve redirect included)."""
    allow_redirects_to: tuple[str, ...] = ()
    """Address classes (``private``, ``loopback``, ``link-local``) a redirect may lead to from
    an origin of another class. By default a redirect is followed only to a public address or
    to one of the origin's own class (local test servers, on-premises mirrors)."""
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        owner = "HfOptions"
        _options.check_optional_str(owner, "endpoint", self.endpoint)
        _options.check_endpoint(owner, "endpoint", self.endpoint)
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"{owner}.endpoint={self.endpoint!r}: use an http(s):// URL such as "
                f"{DEFAULT_ENDPOINT!r}, or leave it unset for HF_ENDPOINT"
            )
        if self.token is not None and not isinstance(self.token, str | bool):
            raise ConfigError(
                f"{owner}.token=<{type(self.token).__name__}>: use a token string, False to "
                "send none, or leave it unset for HF_TOKEN"
            )
        _options.check_int(owner, "part_size", self.part_size, 1 << 16, " bytes")
        _options.check_int(owner, "max_parallel_parts", self.max_parallel_parts, 1)
        timeout = self.request_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ConfigError(
                f"{owner}.request_timeout_s={timeout!r}: use a number of seconds > 0, or None for no limit"
            )
        _options.check_rate(owner, self.min_bytes_per_s, self.rate_window_s, self.max_request_s)
        _options.check_int(owner, "max_redirects", self.max_redirects, 1)
        allow = self.allow_redirects_to
        if isinstance(allow, str) or not all(c in ADDRESS_CLASSES[1:] for c in allow):
            raise ConfigError(f"{owner}.allow_redirects_to={allow!r}: use a list of "
                              f"{', '.join(map(repr, ADDRESS_CLASSES[1:]))}")
        object.__setattr__(self, "allow_redirects_to", tuple(allow))
        object.__setattr__(self, "retry_policy", _options.retry_policy(owner, self.retry_policy))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every option name (``store_options`` keys of ``hf://`` besides the runtime ones)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_store_options(cls, store_options: Mapping[str, Any]) -> HfOptions:
        """Options from ``store_options`` keys (over ``options=HfOptions(...)`` if given).

        Unknown keys raise a :class:`ConfigError` that lists the accepted ones; the runtime
        keys (``session``, ``uploader``, ``environ``) are not options and are refused here.
        """
        _options.check_keys("hf", store_options, (*cls.keys(), "options"))
        given = dict(store_options)
        found = given.pop("options", None)
        if found is None:
            return cls(**given)
        if not isinstance(found, HfOptions):
            raise ConfigError(
                f"options={type(found).__name__}: use an HfOptions, or pass its fields as keys"
            )
        return dataclasses.replace(found, **given)


__all__ = ["DEFAULT_ENDPOINT", "HfOptions"]
