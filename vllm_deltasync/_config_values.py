"""The one validator of ``SyncConfig`` options: a :class:`Rule` per field, and the cpu list syntax.

A rule says what a field holds (its kind), its range, and its environment variable. It turns
what a source gives (an environment string, a JSON value, a Python value) into the field's
value, or raises a :class:`ConfigError` naming the option (the variable or key that held it),
what is wrong and what to use. Every kind refuses what would hang or exhaust a process later:

* numbers are finite and inside the stated range (no ``nan``, no ``inf``, no ``1e-300``
  interval that turns a timer into a busy loop);
* integers are ASCII digits only (``int()`` alone takes ``5_0`` and non-ASCII digits);
* sets and lists are bounded (a cpu list names cpus below :data:`MAX_CPUS`; at most
  :data:`MAX_MIRRORS` mirrors, :data:`MAX_LORAS` adapters);
* URLs follow the credential rule of :mod:`vllm_deltasync._urls` and are never echoed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_deltasync._urls import check_bucket_url, check_http_url
from vllm_deltasync.errors import ConfigError

MAX_CPUS = 8192
"""Cpu numbers are below this: the largest ``CONFIG_NR_CPUS`` a Linux x86-64 kernel is built
with (``MAXSMP``). A cpu list naming a higher one is refused before any set is built."""

MAX_CPU_LIST_CHARS = 4096
"""Longest cpu list text (``"0,2,4,...,254"`` is 600 characters)."""

MAX_MIRRORS = 16
MAX_LORAS = 64

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""ASCII only (``re`` with a str pattern would match any Unicode digit for ``\\d``)."""
_MAX_NUMBER_CHARS = 40
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_ADAPTER_NAMES = frozenset({
    # the other rows of the target table
    "policy", "drafter",
    # keys of the wire dicts an adapter's entry sits beside (server/messages.py: a rank's
    # status, the engine status; server/metrics.py: /synced); tests/server/test_lora_versions.py
    # checks this list against them
    "rank", "model", "applied_step", "applied_id", "staged_step", "ready_steps", "ready_ids",
    "branch_lost", "newest_step", "applied_published_at", "newest_published_at",
    "last_discovery_at", "staged_bytes", "last_error", "pending_switch", "last_apply", "bucket",
    "staging_cpus", "counters", "fingerprint", "model_steps", "pid", "refused", "following",
    "reloads", "cpu_kernels", "proof", "layout_bytes", "proof_classes", "versions",
    "active", "weight_version", "failed_ticks", "failing", "metrics_port", "switches",
    "failures", "max_wait_ticks", "ticks", "held", "holds", "ranks", "synced",
    "max_steps_behind", "coordinator",
})
"""Adapter names refused by ``lora_urls``: the other targets' names, and the keys its status
sits beside in the wire dicts (an adapter's status is the value of its name there)."""
"""An adapter name: what requests give as ``model``, a metric label, later a path segment."""


@dataclass(frozen=True)
class Rule:
    """What one option holds. ``kind``: ``str``, ``choice`` (one of ``choices``), ``bool``,
    ``int`` / ``float`` (from ``lo`` to ``hi`` inclusive), ``cpus`` (``auto``, ``inherit`` or
    a cpu list), ``object`` (a JSON object), ``bucket`` (a bucket URL), ``http_urls`` (a tuple
    of http(s) base URLs, comma-separated in the environment), ``buckets_by_name`` (a JSON
    object of adapter name -> bucket URL). ``optional``: None is a value (``none`` in the
    environment). ``env``: the variable, when it is not ``VLLM_DELTASYNC_<FIELD>``.
    ``secret``: the value is never shown in a message."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    optional: bool = False
    choices: tuple[str, ...] = ()
    env: str | None = None
    unit: str = ""
    secret: bool = False

    def parse(self, raw: Any, where: str) -> Any:
        """``raw`` (an environment string or a JSON value) as the field's value, checked."""
        try:
            if isinstance(raw, str) and self.kind not in ("str", "choice", "cpus", "bucket"):
                raw = self._from_text(raw.strip())
            return self.check(raw, where)
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise self.error(where, raw, f"{type(exc).__name__}: {exc}") from None

    def _from_text(self, text: str) -> Any:
        if self.optional and text.lower() in ("none", "null"):
            return None
        if self.kind in ("int", "float") and len(text) > _MAX_NUMBER_CHARS:
            return _Bad(text, "out of range")
        if self.kind == "int":
            return int(text) if _INT.fullmatch(text) else _Bad(text, "not an integer (ASCII digits)")
        if self.kind == "float":
            return float(text) if _FLOAT.fullmatch(text) else _Bad(text, "not a finite number")
        if self.kind == "bool":
            low = text.lower()
            return low in _TRUE if low in _TRUE | _FALSE else _Bad(text, "not true/false")
        if self.kind == "http_urls":
            return tuple(part.strip() for part in text.split(",")) if text else ()
        try:  # object, buckets_by_name
            return json.loads(text)
        except json.JSONDecodeError as exc:
            return _Bad(text, f"not valid JSON ({exc.msg} at {exc.pos})")

    def check(self, value: Any, where: str) -> Any:
        """``value`` (a Python value) if it is of the kind and in range, normalized (an int
        of a float field as a float, a list of URLs as a tuple, a mapping as a dict)."""
        if isinstance(value, _Bad):
            raise self.error(where, value.text, value.why)
        if value is None and self.optional:
            return None
        checker = _CHECKS[self.kind]
        return checker(self, value, where)

    def error(self, where: str, value: Any, why: str) -> ConfigError:
        shown = "<not shown>" if self.secret else _short(value)
        return ConfigError(f"{where}={shown}: {why}; {self.expects()}")

    def expects(self) -> str:
        """What to use, for a message: ``use a number from 0.01 to 3600 seconds``."""
        extra = ", or none" if self.optional else ""
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a number"
            return f"use {what} from {_num(self.lo)} to {_num(self.hi)}{self.unit}{extra}"
        if self.kind == "choice":
            return "use " + " or ".join(repr(c) for c in self.choices)
        return _EXPECTS[self.kind] + extra


class _Bad:
    """An environment string that is not of the kind (refused by :meth:`Rule.check`)."""

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _num(x: float | None) -> str:
    return "-" if x is None else (str(int(x)) if float(x).is_integer() else repr(x))


def _check_str(rule: Rule, value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise rule.error(where, value, f"a {type(value).__name__}, not a string")
    return value


def _check_choice(rule: Rule, value: Any, where: str) -> str:
    if not isinstance(value, str) or value not in rule.choices:
        raise rule.error(where, value, "not a known value")
    return value


def _check_bool(rule: Rule, value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise rule.error(where, value, "not true/false")
    return value


def _check_number(rule: Rule, value: Any, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise rule.error(where, value, f"a {type(value).__name__}, not a number")
    if rule.kind == "int" and not isinstance(value, int):
        raise rule.error(where, value, "not an integer")
    if not math.isfinite(value):
        raise rule.error(where, value, "not a finite number")
    if (rule.lo is not None and value < rule.lo) or (rule.hi is not None and value > rule.hi):
        raise rule.error(where, value, "out of range")
    return float(value) if rule.kind == "float" else value


def _check_cpus(rule: Rule, value: Any, where: str) -> str:
    _check_str(rule, value, where)
    if value not in ("auto", "inherit"):
        try:
            parse_cpu_list(value)
        except ValueError as exc:
            raise rule.error(where, value, str(exc)) from None
    return str(value)


def _check_object(rule: Rule, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise rule.error(where, value, "not a JSON object")
    return dict(value)


def _check_bucket(rule: Rule, value: Any, where: str) -> str:
    _check_str(rule, value, where)
    if value and "://" not in value:
        raise ConfigError(f"{where} is not a URL (no '://'); {rule.expects()}")
    if value:
        check_bucket_url(value, what=where)
    return str(value)


def _check_http_urls(rule: Rule, value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise rule.error(where, "<not shown>", "not a list of URLs")
    if len(value) > MAX_MIRRORS:
        raise ConfigError(f"{where}: {len(value)} URLs, at most {MAX_MIRRORS}")
    urls = tuple(check_http_url(url, f"{where}[{i}]").rstrip("/") for i, url in enumerate(value))
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where}: a URL is listed twice; list each mirror once")
    return urls


def _check_buckets_by_name(rule: Rule, value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} is not a JSON object; {rule.expects()}")
    if len(value) > MAX_LORAS:
        raise ConfigError(f"{where}: {len(value)} adapters, at most {MAX_LORAS}")
    out = {}
    for name, url in value.items():
        if not isinstance(name, str) or not _LORA_NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: adapter name {_short(name)} is not a valid name; use 1-64 ASCII "
                "letters, digits, '.', '_' or '-', starting with a letter or digit")
        if name in RESERVED_ADAPTER_NAMES:
            raise ConfigError(
                f"{where}: adapter name {name!r} is reserved (a target or a status field of "
                "the same name exists); name the adapter otherwise, e.g. 'lora-" + name + "'")
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"{where}[{name!r}] is not a bucket URL; use e.g. "
                              "s3://bucket/adapters/<name> or hf://buckets/ns/name/<name>")
        check_bucket_url(url, what=f"{where}[{name!r}]")
        out[name] = url
    return out


_CHECKS = {
    "str": _check_str, "choice": _check_choice, "bool": _check_bool, "int": _check_number,
    "float": _check_number, "cpus": _check_cpus, "object": _check_object,
    "bucket": _check_bucket, "http_urls": _check_http_urls,
    "buckets_by_name": _check_buckets_by_name,
}

_EXPECTS = {
    "str": "use a string",
    "bool": "use true or false (1/0, yes/no, on/off)",
    "cpus": "use 'auto', 'inherit' or a cpu list such as '2,3' or '2-5' (cpus below "
            f"{MAX_CPUS})",
    "object": "use a JSON object",
    "bucket": "use a bucket URL such as file:///path/bucket, s3://bucket/prefix or "
              "hf://buckets/ns/name",
    "http_urls": f"use up to {MAX_MIRRORS} comma-separated http(s) base URLs, without "
                 "credentials",
    "buckets_by_name": "use a JSON object of adapter name -> bucket URL, e.g. "
                       "'{\"math\": \"s3://bucket/adapters/math\"}'",
}


def parse_cpu_list(text: str, limit: int = MAX_CPUS) -> frozenset[int]:
    """``"0-3,5"`` -> ``{0, 1, 2, 3, 5}`` (the kernel's cpu list syntax); ValueError if it is
    not one, names no cpu, or names a cpu >= ``limit`` (checked before any set is built: the
    set is at most ``limit`` entries)."""
    if len(text) > MAX_CPU_LIST_CHARS:
        raise ValueError(f"cpu list longer than {MAX_CPU_LIST_CHARS} characters")
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not _digits(first) or (dash and not _digits(last)):
            raise ValueError(f"{part!r} is not a cpu number or range")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"range {part!r} goes backwards")
        if hi >= limit:
            raise ValueError(f"cpu {(last or first)[:12]} is beyond the largest cpu number "
                             f"({limit - 1})")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("no cpu listed")
    return frozenset(cpus)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


__all__ = ["MAX_CPUS", "MAX_LORAS", "MAX_MIRRORS", "RESERVED_ADAPTER_NAMES", "Rule", "parse_cpu_list"]
