"""``SyncConfig``: how a rollout server follows a bucket.

Built from two sources, the second winning per field:

1. ``--additional-config '{"deltasync": {"url": "file:///data/bucket", "poll_interval_s": 1}}'``
   (reaches every vLLM process as ``vllm_config.additional_config``);
2. environment variables ``VLLM_DELTASYNC_<FIELD>`` in upper case, e.g. ``VLLM_DELTASYNC_URL``,
   ``VLLM_DELTASYNC_POLL_INTERVAL_S`` (inherited by every process vLLM starts); ``mirror_urls``
   is ``VLLM_DELTASYNC_MIRRORS`` (:data:`ENV_NAMES`).

Both are read by :meth:`SyncConfig.from_sources`, which takes the mappings as arguments, so
nothing here touches ``os.environ``. The URL may carry credentials (``s3://key:secret@...``);
``repr`` and :meth:`SyncConfig.redacted_url` never show them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import ConfigError

ENV_PREFIX = "VLLM_DELTASYNC_"
ENV_NAMES = {"mirror_urls": "MIRRORS"}
"""Options whose variable is not ``VLLM_DELTASYNC_<OPTION>``: ``mirror_urls`` is read from
``VLLM_DELTASYNC_MIRRORS``."""


def env_name(option: str) -> str:
    """The environment variable of ``option``."""
    return ENV_PREFIX + ENV_NAMES.get(option, option.upper())
ADDITIONAL_CONFIG_KEY = "deltasync"

OnStart = Literal["catch_up", "wait"]
InFlight = Literal["continue", "drain"]


@dataclass(frozen=True)
class SyncConfig:
    """Options of the engine extension. Every field has a ``VLLM_DELTASYNC_*`` variable."""

    url: str = field(repr=False)
    """Bucket URL (``file://``, ``memory://``, ``hf://buckets/...``, ``s3://...``). Required."""

    drafter_url: str = field(default="", repr=False)
    """Speculative decoding: the bucket the draft model's steps are published to (its own
    ``DeltaPublisher``). Empty: the drafter keeps its loaded weights. The drafter follows like
    the policy (shard map, proof, staging bound) and switches on every rank at once, between
    batches; it never holds a policy switch back, and a drafter that fails keeps its last good
    weights (rejection sampling keeps the output distribution whatever the draft)."""

    drafter_prefix: str = ""
    """Speculative decoding with the draft head's tensors in the policy's own bucket (an EAGLE
    head trained with the policy and published in the same ``publish`` call under this prefix,
    e.g. ``eagle.fc.weight``): tensors whose names start with it are the drafter's, and the
    name without it is the tensor's name in the draft's checkpoint
    (``speculative_config.model``). The policy ignores them; the drafter follows the policy's
    bucket, reading only its own tensors, and switches in the same tick as the policy. Excludes
    ``drafter_url``."""

    poll_interval_s: float = 2.0
    """Seconds between two looks for a newer manifest; also how often the engine core checks
    whether all ranks have a step staged."""

    download_concurrency: int = 8
    """Data files downloaded at the same time by one rank."""

    max_staged_bytes: int = 1 << 30
    """Host bytes of decoded, translated steps waiting to be applied, per rank. One step larger
    than this is still staged when nothing else is (alone), so a big anchor cannot block."""

    max_device_staged_bytes: int = 256 << 20
    """Of those, bytes that may live on the accelerator (GPU engines), per rank: the staged
    pieces of parameters on a GPU go to the device until this is reached, the rest wait in
    pinned host memory and are copied at the switch (a longer pause, no device memory).
    vLLM gives ``gpu_memory_utilization`` of the device to weights and KV cache: leave at least
    this much outside it. 0: stage everything on the host."""

    on_start: OnStart = "catch_up"
    """``catch_up``: go to the newest committed step as soon as it is staged. ``wait``: keep
    serving the loaded checkpoint until a step newer than the newest at start is committed.
    Either way the first step applied is reached through its anchor (the version of the loaded
    checkpoint is unknown), unless ``loaded_step`` says which step it is."""

    loaded_step: int | None = None
    """The bucket step the checkpoint vLLM loaded is bit-identical to (e.g. the trainer saved
    it at that step). Deltas then apply on it directly, without downloading an anchor first."""

    in_flight: InFlight = "continue"
    """What running requests do at a switch. ``continue``: they keep generating on the new
    weights from the next batch on (their output carries both versions in ``weight_versions``).
    ``drain``: new requests are held back until running ones finish, then the step applies."""

    reset_prefix_cache: bool = True
    """Drop the prefix cache at each switch, so KV blocks computed with old weights never serve a
    new request. ``False`` keeps them (faster, but outputs mix versions)."""

    max_chain: int = 64
    """Longest delta chain followed before jumping to the newest anchor instead."""

    max_drain_wait_s: float = 60.0
    """With ``in_flight="drain"``: longest wait for running requests before switching anyway."""

    update_wait_s: float = 60.0
    """vLLM's weight-transfer API, backend ``deltasync`` (docs/extension.md): longest time the
    trainer's ``update_weights({"step": N})`` waits for every rank to have step ``N`` staged
    before it fails naming the step. The engine core schedules no batch while it waits."""

    min_version_wait_s: float = 5.0
    """HTTP: longest time a request with ``X-Min-Weight-Version: N`` waits for step ``N`` to be
    applied before it is answered 409 (``Retry-After``); ``0``: answer at once."""

    metrics_port: int = 9464
    """The engine core serves ``GET /metrics`` (Prometheus) and ``GET /synced`` (JSON: each
    rank's applied step, newest step, last error) on this port; ``0`` turns it off. With data
    parallel, the engine core of DP rank ``k`` serves on ``metrics_port + k``."""

    metrics_host: str = "0.0.0.0"
    """Address the metrics endpoint listens on."""

    debug_ring_size: int = 4096
    """Model steps remembered per rank with the weight version they ran on (``deltasync_trace``)."""

    node_cache: str = "auto"
    """One download per node (``stores/nodecache.py``): the ranks of one engine on one node read
    the bucket through a shared local cache, and only one of them runs discovery. ``auto``: on
    when the engine runs more than one rank and the bucket is not a local ``file://`` one;
    ``on``; ``off`` (every rank follows alone)."""

    node_cache_dir: str = ""
    """Where that cache lives; empty: ``/dev/shm/vllm-deltasync-<uid>`` (RAM, one per user), or
    ``<system temp folder>/vllm-deltasync-<uid>`` where there is no ``/dev/shm``. The directory
    must be private to the user running the server: created 0700, and refused at start when it
    is owned by someone else, open to group or others, or a symlink (stores/nodecache.py)."""

    cpu_kernels: str = "packed"
    """CPU build only (no effect on GPUs): how linear layers compute while following
    (``server/worker/packed.py``). ``packed`` (default): vLLM's packed GEMM kernels, as a stock
    engine, packed again for the layers a switch wrote (the switch pause grows by the
    repacking; the linear weights are held twice). ``inplace``: no packing, the layers compute
    from their parameters as on GPUs (writes visible at once, short pauses, about half the
    decode speed). benchmarks/RESULTS.md measures both (``serving``)."""

    decoder: str = "auto"
    """How ``sparse-v3`` chunks decode on this server. ``auto``: one pass compiled by numba (a
    dependency of vLLM) where numba imports and compiles, else numpy; ``numpy``: numpy only,
    ~1.5x slower, without loading numba (~160 MiB less RSS per rank)."""

    staging_cpus: str = "auto"
    """CPU build: the cores the rank's staging threads (download, verify, decode, packing
    ahead) run on (``server/worker/affinity.py``). vLLM binds each worker to its OpenMP cores
    (``VLLM_CPU_OMP_THREADS_BIND``) and threads inherit that binding, so by default staging
    would share the forward pass's cores. ``auto``: the cores the server may use (cgroup,
    parent process's mask) outside the worker's binding and outside the other ranks' (an
    explicit ``VLLM_CPU_OMP_THREADS_BIND`` list; with ``auto`` binding, the other NUMA nodes),
    e.g. the cores vLLM reserves for the engine core; the binding is kept where none is free.
    ``inherit``: keep the binding. A cpu list (``"2,3"``, ``"2-5"``): those cores."""

    mirror_urls: tuple[str, ...] = ()
    """HTTP caches data objects are read from before the bucket (base URLs; comma-separated in
    ``VLLM_DELTASYNC_MIRRORS``): ``GET <mirror>/<key>`` with ``Range``, ``<key>`` the object's
    path under ``url`` (docs/transports.md, "Mirrors"). Manifests and discovery stay on the
    bucket, every byte is checked against its manifest whoever served it, a mirror that fails
    is skipped for a while (the bucket serves). No credentials in a mirror URL."""

    fetch_jitter_s: float | None = None
    """Replicas that discover a step at the same moment spread their downloads: each waits a
    random time in [0, fetch_jitter_s) before downloading a step. None: ``min(poll_interval_s,
    5)`` on a network bucket (hf://, s3://), 0 on file:// and memory://; 0: no wait."""

    store_options: dict[str, Any] = field(default_factory=dict, repr=False)
    """Options for the bucket backend, as a JSON object (``VLLM_DELTASYNC_STORE_OPTIONS=
    '{"addressing_style": "path"}'``): e.g. ``endpoint_url``/``region_name``/``addressing_style``
    for ``s3://``, ``endpoint`` for ``hf://`` (docs/transports.md). Prefer the SDKs' own
    credential chains to keys here; this field is never shown in ``repr`` or logs."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ConfigError(
                f"deltasync url {redact_url(str(self.url))!r} is not a URL; set "
                "VLLM_DELTASYNC_URL or additional_config.deltasync.url to e.g. file:///path/bucket"
            )
        if self.drafter_url and "://" not in self.drafter_url:
            raise ConfigError(
                f"deltasync drafter_url {redact_url(self.drafter_url)!r} is not a URL; set "
                "VLLM_DELTASYNC_DRAFTER_URL to the draft model's bucket, e.g. file:///path/draft"
            )
        if self.drafter_url and self.drafter_prefix:
            raise ConfigError(
                "deltasync drafter_url and drafter_prefix are both set: the draft's tensors "
                "come either from their own bucket (drafter_url) or from the policy's bucket "
                "under a prefix (drafter_prefix); set one")
        if self.drafter_prefix != self.drafter_prefix.strip() or (
                self.drafter_prefix and not self.drafter_prefix.strip(".")):
            raise ConfigError(
                f"deltasync drafter_prefix {self.drafter_prefix!r} must be a name prefix such "
                "as 'eagle.' (no surrounding spaces)")
        _positive(self, "poll_interval_s", "download_concurrency", "max_staged_bytes",
                  "max_chain", "debug_ring_size", "update_wait_s")
        if self.max_device_staged_bytes < 0:
            raise ConfigError(f"deltasync max_device_staged_bytes={self.max_device_staged_bytes} "
                              "must be >= 0 (0: stage on the host only)")
        if self.max_drain_wait_s < 0:
            raise ConfigError(f"deltasync max_drain_wait_s={self.max_drain_wait_s} must be >= 0")
        if not 0 <= self.min_version_wait_s <= 3600:
            raise ConfigError(f"deltasync min_version_wait_s={self.min_version_wait_s} must be "
                              "between 0 and 3600 seconds")
        if self.on_start not in ("catch_up", "wait"):
            raise ConfigError(f"deltasync on_start={self.on_start!r}: use 'catch_up' or 'wait'")
        if self.loaded_step is not None and self.loaded_step < 0:
            raise ConfigError(f"deltasync loaded_step={self.loaded_step} must be >= 0")
        if self.in_flight not in ("continue", "drain"):
            raise ConfigError(f"deltasync in_flight={self.in_flight!r}: use 'continue' or 'drain'")
        if self.node_cache not in ("auto", "on", "off"):
            raise ConfigError(f"deltasync node_cache={self.node_cache!r}: use 'auto', 'on' or 'off'")
        if self.cpu_kernels not in ("packed", "inplace"):
            raise ConfigError(
                f"deltasync cpu_kernels={self.cpu_kernels!r}: use 'packed' or 'inplace'"
            )
        if self.decoder not in ("auto", "numpy"):
            raise ConfigError(f"deltasync decoder={self.decoder!r}: use 'auto' or 'numpy'")
        if self.staging_cpus not in ("auto", "inherit"):
            try:
                parse_cpu_list(self.staging_cpus)
            except ValueError as exc:
                raise ConfigError(
                    f"deltasync staging_cpus={self.staging_cpus!r}: {exc}; use 'auto', "
                    "'inherit' or a cpu list such as '2,3' or '2-5'") from None
        if self.mirror_urls:
            from vllm_deltasync.stores.mirrors import check_mirror_urls

            object.__setattr__(self, "mirror_urls",
                               check_mirror_urls(self.mirror_urls, "deltasync mirror_urls"))
        if self.fetch_jitter_s is not None and not 0 <= self.fetch_jitter_s <= 3600:
            raise ConfigError(f"deltasync fetch_jitter_s={self.fetch_jitter_s} must be between 0 "
                              "and 3600 seconds (unset: one poll interval on a network bucket)")
        if not isinstance(self.store_options, Mapping):
            raise ConfigError("deltasync store_options must be a JSON object of backend options")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(
                f"deltasync metrics_port={self.metrics_port}: use 1-65535, or 0 for off"
            )

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr
        )
        return f"SyncConfig(url={self.redacted_url()!r}, {shown})"

    def redacted_url(self) -> str:
        """The URL without user, password or query string (safe to log)."""
        return redact_url(self.url)

    @property
    def follows_drafter(self) -> bool:
        """A speculative drafter follows: from its own bucket, or from the policy's."""
        return bool(self.drafter_url or self.drafter_prefix)

    def for_drafter(self) -> SyncConfig:
        """The settings of the drafter's rank state: the drafter's bucket (the policy's one
        with ``drafter_prefix``, without the node cache: the policy's poller holds that),
        nothing loaded."""
        if self.drafter_prefix:
            return dataclasses.replace(self, loaded_step=None, node_cache="off")
        return dataclasses.replace(self, url=self.drafter_url, drafter_url="", loaded_step=None)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (url included, unredacted): for passing between processes."""
        return dataclasses.asdict(self)

    @classmethod
    def from_sources(
        cls, additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]
    ) -> SyncConfig:
        """Merge ``additional_config["deltasync"]`` and ``VLLM_DELTASYNC_*`` (env wins)."""
        values: dict[str, Any] = {}
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        if isinstance(section, str):
            section = _json_object(section, "additional_config.deltasync")
        if not isinstance(section, Mapping):
            raise ConfigError("additional_config.deltasync must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        for key, value in section.items():
            if key not in known:
                raise ConfigError(
                    f"additional_config.deltasync has unknown key {key!r}; known: {sorted(known)}"
                )
            values[key] = _coerce(known[key], value, f"additional_config.deltasync.{key}")
        for name, f in known.items():
            raw = environ.get(env_name(name))
            if raw is not None and raw != "":
                values[name] = _coerce(f, raw, env_name(name))
        variables = {env_name(n) for n in known}
        for var in environ:
            if var.startswith(ENV_PREFIX) and var not in variables:
                raise ConfigError(
                    f"environment variable {var} is not a deltasync option; known: "
                    + ", ".join(env_name(n) for n in known)
                )
        if "url" not in values:
            raise ConfigError(
                "deltasync needs a bucket URL: set VLLM_DELTASYNC_URL or "
                "--additional-config '{\"deltasync\": {\"url\": \"file:///path/to/bucket\"}}'"
            )
        return cls(**values)


def is_configured(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> bool:
    """True when a URL is given by either source (the extension then follows a bucket)."""
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
    return bool(environ.get(ENV_PREFIX + "URL")) or (
        isinstance(section, Mapping) and bool(section.get("url"))
    )


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,5"`` -> ``{0, 1, 2, 3, 5}`` (the kernel's cpu list syntax); ValueError if it is
    not one, or names no cpu."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a cpu number or range")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"range {part!r} goes backwards")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("no cpu listed")
    return frozenset(cpus)


def _positive(cfg: SyncConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"deltasync {name}={getattr(cfg, name)} must be > 0")


def _json_object(text: str, where: str) -> Mapping[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a JSON object")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """Convert a JSON value or an environment string to the field's type."""
    kind = str(f.type)
    try:
        if value is None and "None" in kind:
            return None
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError("expected true/false")
        if kind.startswith("int"):
            if isinstance(value, str) and value.strip().lower() in ("", "none"):
                return None
            if isinstance(value, (float, bool)):
                raise ValueError("expected an integer")
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("tuple"):  # a list in JSON, comma-separated in a variable
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip() for i in items if str(i).strip())
        if kind.startswith("dict"):
            return dict(_json_object(value, where) if isinstance(value, str) else value)
        return str(value)
    except (TypeError, ValueError) as exc:
        shown = "<hidden>" if kind.startswith("dict") else repr(value)  # may hold credentials
        raise ConfigError(f"{where}={shown} is not a valid {kind}: {exc}") from exc


__all__ = ["ENV_NAMES", "ENV_PREFIX", "ConfigError", "SyncConfig", "is_configured", "parse_cpu_list"]
