"""Checks shared by the option objects of the network stores (``S3Options``, ``HfOptions``).

Every message names the option and says what to use instead; values of secret options
(credentials, tokens) are never echoed.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_deltasync._urls import CREDENTIAL_SOURCES, credential_refusal, has_credentials
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores._retry import RetryPolicy


def check_keys(scheme: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """Refuse ``store_options`` keys the ``scheme://`` backend does not know, listing the known ones."""
    known = list(accepted)
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise ConfigError(
        f"{scheme}:// store_options: unknown option{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(hints)}; accepted: {', '.join(known)}"
    )


def check_int(owner: str, name: str, value: Any, minimum: int, unit: str = "") -> None:
    """``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name}={value!r}: use an integer{unit} >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name}={value}: use {minimum}{unit} or more")


def check_optional_str(owner: str, name: str, value: Any, *, secret: bool = False) -> None:
    """``value`` is None or a string (a secret's value is not shown)."""
    if value is not None and not isinstance(value, str):
        shown = f"<{type(value).__name__}>" if secret else repr(value)
        raise ConfigError(f"{owner}.{name}={shown}: use a string, or leave it unset")


def check_endpoint(owner: str, name: str, value: Any) -> None:
    """An endpoint URL carries no credential in any spelling (``_urls.has_credentials``: an
    ``@`` after the scheme); one that may is refused without being shown (the SDKs log their
    endpoint at debug level, and messages name it)."""
    if isinstance(value, str) and has_credentials(value):
        raise credential_refusal(value, f"{owner}.{name}", "an endpoint takes none; "
                                 + CREDENTIAL_SOURCES)


def check_rate(owner: str, min_bytes_per_s: Any, rate_window_s: Any, max_request_s: Any) -> None:
    """The transfer bounds shared by the network stores: a minimum rate over a window and a
    cap per request (None turns the rate, or the cap, off)."""
    for name, value, optional in (("rate_window_s", rate_window_s, False),
                                  ("max_request_s", max_request_s, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{owner}.{name}={value!r}: use a number of seconds > 0"
                              + (", or None for no cap" if optional else ""))
    if min_bytes_per_s is not None:
        check_int(owner, "min_bytes_per_s", min_bytes_per_s, 1, " bytes per second")


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name}={value!r}: use True or False")


def retry_policy(owner: str, value: Any) -> RetryPolicy:
    """A :class:`RetryPolicy` from ``None`` (the defaults), a policy, or a mapping of its fields
    (what a JSON ``store_options`` can carry)."""
    if value is None:
        return RetryPolicy()
    if isinstance(value, RetryPolicy):
        return value
    if isinstance(value, Mapping):
        accepted = [f.name for f in dataclasses.fields(RetryPolicy)]
        unknown = [k for k in value if k not in accepted]
        if unknown:
            raise ConfigError(
                f"{owner}.retry_policy: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(accepted)}"
            )
        try:
            return RetryPolicy(**value)
        except ConfigError as exc:
            raise ConfigError(f"{owner}.retry_policy: {exc}") from None
        except TypeError as exc:  # a comparison of a value of the wrong type
            raise ConfigError(
                f"{owner}.retry_policy={dict(value)!r}: attempts is an integer, the delays are numbers of seconds"
            ) from exc
    raise ConfigError(
        f"{owner}.retry_policy={value!r}: use a vllm_deltasync.stores.RetryPolicy, a mapping of "
        "its fields (attempts, base_delay_s, max_delay_s, max_rate_limit_wait_s) or None"
    )


def with_prefix(where: str, exc: ConfigError) -> ConfigError:
    """``exc`` with the store it was opening for in front (its class kept)."""
    return type(exc)(f"{where}: {exc}")


__all__ = ["check_bool", "check_endpoint", "check_int", "check_rate", "check_keys", "check_optional_str", "retry_policy", "with_prefix"]
