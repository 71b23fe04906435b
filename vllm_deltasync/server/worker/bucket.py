"""How a rank reaches its bucket: the store (mirrors below the node cache), the discovery
intervals, and the wait before a download (no thundering herd). Plain functions of the
``SyncConfig``: the poller uses them, and ``benchmarks/bench_fleet.py`` runs its simulated
replicas with the same values."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.server.worker.discovery import StepWatcher
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.base import Store
from vllm_deltasync.stores.mirrors import MirroredStore


def open_node_store(config: SyncConfig, node_ranks: int) -> Store:
    """The bucket's store, read through the node cache when ``config.node_cache`` asks for it
    (``auto``: when the engine runs more than one rank and the bucket is remote; a ``file://``
    bucket is already on the node)."""
    store = open_store(config.url, **dict(config.store_options))
    if config.mirror_urls:  # data objects from the mirrors first (below the node cache)
        store = MirroredStore(store, config.mirror_urls)
    if config.node_cache == "off" or (config.node_cache == "auto" and (
            node_ranks < 2 or store.scheme in ("file", "memory"))):
        return store
    from vllm_deltasync.stores.nodecache import NodeCachedStore, cache_root, default_base

    base = Path(config.node_cache_dir) if config.node_cache_dir else default_base()
    return NodeCachedStore(store, cache_root(base, config.url),
                           ttl_s=max(600.0, 100 * config.poll_interval_s))


class WatchIntervals(TypedDict):
    probe_interval_s: float
    listing_interval_s: float
    empty_listing_interval_s: float


def watcher_options(config: SyncConfig) -> WatchIntervals:
    """The discovery intervals of a rank (``StepWatcher`` keywords; benchmarks/bench_fleet.py
    runs its replicas with them): a probe every poll interval, a listing every minute."""
    return {"probe_interval_s": config.poll_interval_s,
            "listing_interval_s": max(60.0, config.poll_interval_s),
            "empty_listing_interval_s": config.poll_interval_s}


def open_reader(config: SyncConfig, node_ranks: int, fingerprint: str | None,
                cpus: Any) -> BucketReader:
    """The rank's reader of its bucket (through the node cache and mirrors), its decode pool
    sized by the staging cores (``cpus``, none known: the default)."""
    return BucketReader(open_node_store(config, node_ranks),
                        max_concurrency=config.download_concurrency, fingerprint=fingerprint,
                        decode_threads=min(8, len(cpus)) if cpus else 0)


def open_watcher(config: SyncConfig, store: Store) -> StepWatcher:
    """Discovery on ``store``, backing off like the store's retries (``retry_policy``)."""
    return StepWatcher(store, **watcher_options(config),
                       retry_policy=getattr(store, "retry_policy", None))


def branch_check_s(config: SyncConfig) -> float:
    """How often the applied step's manifest is read again while no newer step continues it."""
    return min(60.0, max(2.0, 10 * config.poll_interval_s))


def fetch_jitter_s(config: SyncConfig, scheme: str) -> float:
    """The longest random wait before downloading a newly discovered step: ``fetch_jitter_s``
    when set, else on a network bucket one poll interval, at most 5 s (replicas probing at
    random phases already discover a step within one poll interval of each other, or all at
    once through the events feed: their downloads then spread over about that much more), and
    none on ``file://`` and ``memory://`` (no remote origin to spare)."""
    if config.fetch_jitter_s is not None:
        return config.fetch_jitter_s
    return 0.0 if scheme in ("file", "memory") else min(config.poll_interval_s, 5.0)


__all__ = ["WatchIntervals", "branch_check_s", "fetch_jitter_s", "open_node_store", "open_reader",
           "open_watcher", "watcher_options"]
