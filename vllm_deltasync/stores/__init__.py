"""Bucket backends chosen by URL scheme.

``open_store(url)`` imports a backend only when its scheme is used and says which extra to
install when a backend's dependency is missing.

==========  ==========================================  =========================
scheme      backend                                     extra
==========  ==========================================  =========================
file://     local directory (atomic temp + rename)      (none)
memory://   process-local dict, for tests and demos     (none)
hf://       Hugging Face Storage Buckets                ``vllm-deltasync[hf]``
s3://       S3 and S3-compatible (R2, MinIO, Hub)       ``vllm-deltasync[s3]``
==========  ==========================================  =========================

The network backends take their options as one object (``S3Options`` in
:mod:`vllm_deltasync.stores.s3`, ``HfOptions`` in :mod:`vllm_deltasync.stores.hf`) or, the same
names, as ``open_store`` keyword arguments. :class:`RetryPolicy` is shared by both.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_deltasync._urls import KNOWN_SCHEMES, check_bucket_url, redact_url
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores._retry import RetryPolicy
from vllm_deltasync.stores.base import ObjectInfo, Store, StoreStats

# scheme -> (module, class, extra needed for its dependencies or None)
_REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "file": ("vllm_deltasync.stores.local", "LocalStore", None),
    "memory": ("vllm_deltasync.stores.memory", "MemoryStore", None),
    "hf": ("vllm_deltasync.stores.hf", "HfStore", "hf"),
    "s3": ("vllm_deltasync.stores.s3", "S3Store", "s3"),
}

# scheme -> the URL form a refusal of a malformed URL of that scheme names
_FORMS: dict[str, str] = {
    "file": "file:///path/to/bucket (or a bare path)",
    "memory": "memory://<name>",
    "hf": "hf://buckets/<namespace>/<name>[/<prefix>]",
    "s3": "s3://<bucket>[/<prefix>]",
}


def register_store(scheme: str, module: str, cls: str, extra: str | None = None) -> None:
    """Make ``open_store`` serve ``scheme://`` URLs with ``module.cls``."""
    _REGISTRY[scheme] = (module, cls, extra)


def split_scheme(url: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a bare path is ``file``. (``open_store`` refuses a
    known scheme without ``//`` first: ``s3:b/p`` is malformed, not the path ``s3:b/p``.)"""
    if "://" not in url:
        return "file", url
    scheme, rest = url.split("://", 1)
    return scheme.lower(), rest


def open_store(url: str, **options: Any) -> Store:
    """The store for ``url``. ``options`` go to the backend's ``from_url`` (its ``store_options``:
    for s3:// and hf:// the fields of ``S3Options`` / ``HfOptions``; unknown keys are refused)."""
    # no credentials or query strings in a bucket URL; "s3:K:S@b/p", "hf:buckets/..." and
    # "s3:///..." are malformed URLs, refused without echoing them, never local paths
    check_bucket_url(url, frozenset(KNOWN_SCHEMES) | frozenset(_REGISTRY), _FORMS)
    scheme, _ = split_scheme(url)
    try:
        module_name, cls_name, extra = _REGISTRY[scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise ConfigError(f"bucket URL {redact_url(url)!r}: unknown scheme {scheme!r}; use one of {known}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with `pip install 'vllm-deltasync[{extra}]'`" if extra else ""
        raise ConfigError(f"bucket URL {redact_url(url)!r}: the {scheme}:// backend cannot be imported ({exc}){hint}") from exc
    cls = getattr(module, cls_name)
    store: Store = cls.from_url(url, **options)
    return store


__all__ = ["ObjectInfo", "RetryPolicy", "Store", "StoreStats", "open_store", "register_store", "split_scheme"]
