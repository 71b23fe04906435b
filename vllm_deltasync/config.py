"""``SyncConfig``: how a rollout server follows a bucket.

Built from two sources, the second winning per field:

1. ``--additional-config '{"deltasync": {"url": "file:///data/bucket", "poll_interval_s": 1}}'``
   (reaches every vLLM process as ``vllm_config.additional_config``);
2. environment variables, ``VLLM_DELTASYNC_<FIELD>`` in upper case unless the field names
   another (:func:`env_names`: ``mirror_urls`` is ``VLLM_DELTASYNC_MIRRORS``), e.g.
   ``VLLM_DELTASYNC_URL``, ``VLLM_DELTASYNC_POLL_INTERVAL_S`` (inherited by every process vLLM
   starts). Names are exact: ``VLLM_DELTASYNC_Poll_Interval_S`` is refused, not ignored.

Both are read by :meth:`SyncConfig.from_sources`, which takes the mappings as arguments, so
nothing here touches ``os.environ``. Every field has a :class:`~._config_values.Rule` (its
kind, range and variable): one validator, the same in every process, and every failure a
:class:`ConfigError` naming the option and the fix. A URL that may carry a credential
(``s3://KEY:SECRET@...`` in any spelling) is refused without being shown
(:mod:`vllm_deltasync._urls`), so ``repr`` and :meth:`SyncConfig.redacted_url` hold none.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from vllm_deltasync._config_values import Rule, parse_cpu_list
from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import ConfigError

ENV_PREFIX = "VLLM_DELTASYNC_"
ADDITIONAL_CONFIG_KEY = "deltasync"

OnStart = Literal["catch_up", "wait"]
InFlight = Literal["continue", "drain", "keep_kv"]

_T = TypeVar("_T")
_RULE = "rule"
_DAY_S = 86400.0
_BYTES_CAP = 1 << 50  # 1 PiB: a finite bound on every byte count


def _opt(default: _T, rule: Rule, *, repr: bool = True) -> _T:  # noqa: A002 - field()'s name
    """A field with its rule (kind, range, variable) in its metadata."""
    return field(default=default, metadata={_RULE: rule}, repr=repr)


@dataclass(frozen=True)
class SyncConfig:
    """Options of the engine extension. Every field has a ``VLLM_DELTASYNC_*`` variable."""

    url: str = field(repr=False, metadata={_RULE: Rule("bucket", secret=True)})
    """Bucket URL (``file://``, ``memory://``, ``hf://buckets/...``, ``s3://...``). Required.
    Without credentials or query string: a URL with an ``@`` after its scheme (a ``file:///``
    path excepted) is refused, unshown (credentials come from the environment, the SDK's
    chain or ``store_options``)."""

    drafter_url: str = _opt("", Rule("bucket", secret=True), repr=False)
    """Speculative decoding: the bucket the draft model's steps are published to (its own
    ``DeltaPublisher``). Empty: the drafter keeps its loaded weights. The drafter follows like
    the policy (shard map, proof, staging bound) and switches on every rank at once, between
    batches; it never holds a policy switch back, and a drafter that fails keeps its last good
    weights (rejection sampling keeps the output distribution whatever the draft)."""

    drafter_prefix: str = _opt("", Rule("str"))
    """Speculative decoding with the draft head's tensors in the policy's own bucket (an EAGLE
    head trained with the policy and published in the same ``publish`` call under this prefix,
    e.g. ``eagle.fc.weight``): tensors whose names start with it are the drafter's, and the
    name without it is the tensor's name in the draft's checkpoint
    (``speculative_config.model``). The policy ignores them; the drafter follows the policy's
    bucket, reading only its own tensors, and switches in the same tick as the policy. Excludes
    ``drafter_url``."""

    poll_interval_s: float = _opt(2.0, Rule("float", 0.01, 3600.0, unit=" seconds"))
    """Seconds between two looks for a newer manifest; also how often the engine core checks
    whether all ranks have a step staged. From 0.01 to 3600 (a shorter interval is a busy
    loop)."""

    download_concurrency: int = _opt(8, Rule("int", 1, 1024))
    """Data files downloaded at the same time by one rank. From 1 to 1024."""

    max_staged_bytes: int = _opt(1 << 30, Rule("int", 1, _BYTES_CAP, unit=" bytes"))
    """Host bytes of decoded, translated steps waiting to be applied, per rank. One step larger
    than this is still staged when nothing else is (alone), so a big anchor cannot block.
    From 1 to 2**50."""

    max_device_staged_bytes: int = _opt(256 << 20, Rule("int", 0, _BYTES_CAP, unit=" bytes"))
    """Of those, bytes that may live on the accelerator (GPU engines), per rank: the staged
    pieces of parameters on a GPU go to the device until this is reached, the rest wait in
    pinned host memory and are copied at the switch (a longer pause, no device memory).
    vLLM gives ``gpu_memory_utilization`` of the device to weights and KV cache: leave at least
    this much outside it. 0: stage everything on the host. From 0 to 2**50."""

    on_start: OnStart = _opt("catch_up", Rule("choice", choices=("catch_up", "wait")))
    """``catch_up``: go to the newest committed step as soon as it is staged. ``wait``: keep
    serving the loaded checkpoint until a step newer than the newest at start is committed.
    Either way the first step applied is reached through its anchor (the version of the loaded
    checkpoint is unknown), unless ``loaded_step`` says which step it is."""

    loaded_step: int | None = _opt(None, Rule("int", 0, 10**12 - 1, optional=True))
    """The bucket step the checkpoint vLLM loaded is bit-identical to (e.g. the trainer saved
    it at that step). Deltas then apply on it directly, without downloading an anchor first.
    None (``none``), or a step from 0 to 10**12 - 1 (a step's twelve digits)."""

    in_flight: InFlight = _opt("keep_kv", Rule("choice", choices=("continue", "drain", "keep_kv")))
    """What requests running at a switch do (``server/engine/kv.py``; docs/extension.md,
    "Switch semantics"). Whatever the mode, every request admitted after a switch is salted by
    the new weights' identity, so it never reuses prefix-cache blocks of other weights.
    ``keep_kv`` (default): they go on generating on the new weights from the next batch, from
    the KV cache computed so far (nothing is recomputed; the blocks they fill are never reused
    by a request of the new version). ``continue``: they go on on the new weights too, but are
    preempted and compute their whole KV cache again on them first (what vLLM's
    ``reset_prefix_cache(reset_running_requests=True)`` does, for these requests only): their
    remaining tokens are exactly what the new weights give for that prefix, at the cost of
    recomputing every running sequence at every switch. Either way their output carries both
    versions in ``weight_versions``, which say where the switch fell. ``drain``: new requests
    are held back until running ones finish (at most ``max_drain_wait_s``, after which the
    ones left are recomputed as with ``continue``), then the step applies."""

    reset_prefix_cache: bool = _opt(True, Rule("bool"))
    """Deprecated (0.4): no switch drops the prefix cache any more. Every request is salted by
    the weights it runs on, so a request admitted after a switch never reuses blocks of other
    weights whatever this says, and blocks of older versions age out under vLLM's LRU.
    ``false`` keeps what else it did: running requests keep the KV computed so far in every
    ``in_flight`` mode (say ``in_flight=keep_kv`` instead), and a failed switch or a reload
    behind our back leaves the cache in place (the salt suffices). ``true`` (default): a
    failed switch or a reload also drops the prefix cache with the running requests."""

    max_chain: int = _opt(64, Rule("int", 1, 100_000))
    """Longest delta chain followed before jumping to the newest anchor instead. From 1 to
    100000."""

    max_drain_wait_s: float = _opt(60.0, Rule("float", 0.0, _DAY_S, unit=" seconds"))
    """With ``in_flight="drain"``: longest wait for running requests before switching anyway.
    From 0 to 86400."""

    update_wait_s: float = _opt(60.0, Rule("float", 0.001, _DAY_S, unit=" seconds"))
    """vLLM's weight-transfer API, backend ``deltasync`` (docs/extension.md): longest time the
    trainer's ``update_weights({"step": N})`` waits for every rank to have step ``N`` staged
    before it fails naming the step. The engine core schedules no batch while it waits. From
    0.001 to 86400."""

    min_version_wait_s: float = _opt(5.0, Rule("float", 0.0, 3600.0, unit=" seconds"))
    """HTTP: longest time a request with ``X-Min-Weight-Version: N`` waits for step ``N`` to be
    applied before it is answered 409 (``Retry-After``); ``0``: answer at once. From 0 to
    3600."""

    metrics_port: int = _opt(9464, Rule("int", 0, 65535))
    """The engine core serves ``GET /metrics`` (Prometheus) and ``GET /synced`` (JSON: each
    rank's applied step, newest step, last error) on this port; ``0`` turns it off. With data
    parallel, the engine core of DP rank ``k`` serves on ``metrics_port + k``. From 0 to
    65535."""

    metrics_host: str = _opt("0.0.0.0", Rule("str"))
    """Address the metrics endpoint listens on."""

    debug_ring_size: int = _opt(4096, Rule("int", 1, 1 << 20))
    """Model steps remembered per rank with the weight version they ran on (``deltasync_trace``).
    From 1 to 2**20."""

    node_cache: str = _opt("auto", Rule("choice", choices=("auto", "on", "off")))
    """One download per node (``stores/nodecache.py``): the ranks of one engine on one node read
    the bucket through a shared local cache, and only one of them runs discovery. ``auto``: on
    when the engine runs more than one rank and the bucket is not a local ``file://`` one;
    ``on``; ``off`` (every rank follows alone)."""

    node_cache_dir: str = _opt("", Rule("str"))
    """Where that cache lives; empty: ``/dev/shm/vllm-deltasync-<uid>`` (RAM, one per user), or
    ``<system temp folder>/vllm-deltasync-<uid>`` where there is no ``/dev/shm``. The directory
    must be private to the user running the server: created 0700, and refused at start when it
    is owned by someone else, open to group or others, or a symlink (stores/nodecache.py)."""

    cpu_kernels: str = _opt("packed", Rule("choice", choices=("packed", "inplace")))
    """CPU build only (no effect on GPUs): how linear layers compute while following
    (``server/worker/packed.py``). ``packed`` (default): vLLM's packed GEMM kernels, as a stock
    engine, packed again for the layers a switch wrote (the switch pause grows by the
    repacking; the linear weights are held twice). ``inplace``: no packing, the layers compute
    from their parameters as on GPUs (writes visible at once, short pauses, about half the
    decode speed). benchmarks/RESULTS.md measures both (``serving``)."""

    decoder: str = _opt("auto", Rule("choice", choices=("auto", "numpy")))
    """How ``sparse-v3`` chunks decode on this server. ``auto``: one pass compiled by numba (a
    dependency of vLLM) where numba imports and compiles, else numpy; ``numpy``: numpy only,
    ~1.5x slower, without loading numba (~160 MiB less RSS per rank)."""

    staging_cpus: str = _opt("auto", Rule("cpus"))
    """CPU build: the cores the rank's staging threads (download, verify, decode, packing
    ahead) run on (``server/worker/affinity.py``). vLLM binds each worker to its OpenMP cores
    (``VLLM_CPU_OMP_THREADS_BIND``) and threads inherit that binding, so by default staging
    would share the forward pass's cores. ``auto``: the cores the server may use (cgroup,
    parent process's mask) outside the worker's binding and outside the other ranks' (an
    explicit ``VLLM_CPU_OMP_THREADS_BIND`` list; with ``auto`` binding, the other NUMA nodes),
    e.g. the cores vLLM reserves for the engine core; the binding is kept where none is free.
    ``inherit``: keep the binding. A cpu list (``"2,3"``, ``"2-5"``): those cores, each below
    8192 (``_config_values.MAX_CPUS``), the text at most 4096 characters."""

    store_options: dict[str, Any] = field(default_factory=dict, repr=False,
                                          metadata={_RULE: Rule("object", secret=True)})
    """Options for the bucket backend, as a JSON object (``VLLM_DELTASYNC_STORE_OPTIONS=
    '{"addressing_style": "path"}'``): e.g. ``endpoint_url``/``region_name``/``addressing_style``
    for ``s3://``, ``endpoint`` for ``hf://`` (docs/transports.md). Prefer the SDKs' own
    credential chains to keys here; this field is never shown in ``repr`` or logs."""

    mirror_urls: tuple[str, ...] = _opt((), Rule("http_urls", env=ENV_PREFIX + "MIRRORS"))
    """http(s) base URLs of read-only mirrors (HTTP caches) of the bucket: data objects are read
    from ``<mirror>/<key>`` (with ``Range``; ``<key>`` the object's path under ``url``) before
    the bucket, in this order; manifests and discovery stay on the bucket; every byte is checked
    against its manifest whoever served it, and a mirror that fails is skipped for a while
    (``stores/mirrors.py``; docs/transports.md, "Mirrors"). Environment variable
    ``VLLM_DELTASYNC_MIRRORS``, comma-separated (a JSON list of strings in
    ``additional_config``). At most 16, each listed once, without credentials, query string or
    fragment."""

    fetch_jitter_s: float | None = _opt(
        None, Rule("float", 0.0, 600.0, optional=True, unit=" seconds"))
    """A random delay, up to this many seconds, before a rank fetches a step it just
    discovered, so that a fleet does not hit the bucket at the same instant. None (``none``):
    sized from ``poll_interval_s``: ``min(poll_interval_s, 5)`` on a network bucket (hf://,
    s3://), none on file:// and memory:// (``server/worker/bucket.py`` ``fetch_jitter_s``); 0:
    none. From 0 to 600."""

    lora_urls: dict[str, str] = field(default_factory=dict,
                                      metadata={_RULE: Rule("buckets_by_name")})
    """LoRA adapters that follow their own buckets: a JSON object of adapter name -> bucket
    URL (``VLLM_DELTASYNC_LORA_URLS='{"math": "s3://runs/adapters/math"}'``). A name is what
    requests give as ``model``: 1-64 ASCII letters, digits, ``.``, ``_`` or ``-``, starting
    with a letter or digit (no ``@``, no ``/``: it is also a metric label and a path segment).
    Each URL follows the bucket URL rules of ``url``. At most 64. Not ``policy``, ``drafter``
    or a key of the status dicts (``_config_values.RESERVED_ADAPTER_NAMES``). The server needs
    ``--enable-lora`` (docs/extension.md, "LoRA adapters"); a request names ``<name>`` (the
    newest applied step) or ``<name>@<step>`` (exactly that step while it is kept)."""

    lora_versions_kept: int = _opt(2, Rule("int", 1, 64))
    """Versions of each followed adapter kept loaded (the newest and the ones before it, which
    requests still running may use, or name as ``<name>@<step>``). From 1 to 64. A version
    is removed only when no request uses it; a newer step waits for that. vLLM's
    ``--max-cpu-loras`` must hold ``lora_versions_kept`` x the number of adapters."""

    def __post_init__(self) -> None:
        for f in fields(self):  # every field by its rule: kind, range; normalized in place
            value = rule_of(f).check(getattr(self, f.name), f"deltasync {f.name}")
            object.__setattr__(self, f.name, value)
        if not self.url:
            raise ConfigError(
                "deltasync needs a bucket URL: set VLLM_DELTASYNC_URL or "
                "--additional-config '{\"deltasync\": {\"url\": \"file:///path/to/bucket\"}}'")
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

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr
        )
        return f"SyncConfig(url={self.redacted_url()!r}, {shown})"

    def redacted_url(self) -> str:
        """The URL without user, password or query string (safe to log)."""
        return redact_url(self.url)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (url included, unredacted): for passing between processes."""
        return dataclasses.asdict(self)

    @classmethod
    def from_sources(
        cls, additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]
    ) -> SyncConfig:
        """Merge ``additional_config["deltasync"]`` and the ``VLLM_DELTASYNC_*`` variables (a
        variable wins over the key). ConfigError, naming the key or variable and the fix, for
        anything that is not an option or not a valid value of it; never another error."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in deltasync_section(additional_config).items():
            if not isinstance(key, str) or key not in known:
                raise ConfigError(f"additional_config.deltasync has unknown key {key!r}"
                                  f"{_hint(str(key), list(known))}; known: {sorted(known)}")
            values[key] = rule_of(known[key]).parse(value, f"additional_config.deltasync.{key}")
        names = env_names()
        for name, var in names.items():
            raw = environ.get(var)
            if raw is not None and raw != "":
                values[name] = rule_of(known[name]).parse(raw, var)
        _refuse_unknown_variables(environ, names)
        if not values.get("url"):
            raise ConfigError(
                "deltasync needs a bucket URL: set VLLM_DELTASYNC_URL or "
                "--additional-config '{\"deltasync\": {\"url\": \"file:///path/to/bucket\"}}'"
            )
        return cls(**values)


def rule_of(f: dataclasses.Field[Any]) -> Rule:
    """The :class:`Rule` of a ``SyncConfig`` field."""
    rule: Rule = f.metadata[_RULE]
    return rule


def env_names() -> dict[str, str]:
    """Field name -> its environment variable (``VLLM_DELTASYNC_<FIELD>`` unless its rule
    names another)."""
    return {f.name: rule_of(f).env or ENV_PREFIX + f.name.upper() for f in fields(SyncConfig)}


def deltasync_section(additional_config: Any) -> Mapping[str, Any]:
    """``additional_config["deltasync"]``: a mapping (empty when absent or None).

    A JSON string there (``--additional-config`` encoded twice) is refused, not parsed: vLLM
    hands every process the same parsed object, and each reader of it (engine core, workers,
    HTTP layer) would have to decode the string the same way; one that does not leaves the
    extension half-configured. One form, checked in one place, and a message with the fix."""
    if additional_config is None:
        return {}
    if not isinstance(additional_config, Mapping):
        raise ConfigError(f"additional_config is a {type(additional_config).__name__}, not a "
                          "JSON object; use --additional-config '{\"deltasync\": {...}}'")
    section = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if section is None:
        return {}
    if isinstance(section, str):
        raise ConfigError(
            "additional_config.deltasync is a string (JSON encoded twice?): give the object "
            "itself, --additional-config '{\"deltasync\": {\"url\": \"file:///path/bucket\"}}', "
            "or LLM(additional_config={\"deltasync\": {\"url\": ...}})")
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config.deltasync is a {type(section).__name__}, not a "
                          "JSON object of options; use {\"deltasync\": {\"url\": ...}}")
    return section


def _refuse_unknown_variables(environ: Mapping[str, str], names: dict[str, str]) -> None:
    """A variable that looks like ours (the prefix in any case) but is not exactly one."""
    known = set(names.values())
    for var in environ:
        if var.upper().startswith(ENV_PREFIX) and var not in known:
            raise ConfigError(f"environment variable {var} is not a deltasync option"
                              f"{_hint(var, sorted(known))}; known: " + ", ".join(sorted(known)))


def _hint(given: str, known: list[str]) -> str:
    """`` (did you mean X?)``: the exact name of a case variant, else the closest name."""
    same = [k for k in known if k.upper() == given.upper()]
    if same:
        return f" (names are exact: did you mean {same[0]}?)"
    close = difflib.get_close_matches(given, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def is_configured(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> bool:
    """True when a URL is given by either source (the extension then follows a bucket), or
    the ``deltasync`` section is there but not an object (refused then, visibly: a string or
    a list must not leave the extension silently off)."""
    if environ.get(ENV_PREFIX + "URL"):
        return True
    section = (additional_config.get(ADDITIONAL_CONFIG_KEY)
               if isinstance(additional_config, Mapping) else None)
    if section is None:
        return False
    return not isinstance(section, Mapping) or bool(section.get("url"))


__all__ = ["ENV_PREFIX", "ConfigError", "SyncConfig", "deltasync_section", "env_names",
           "is_configured", "parse_cpu_list", "rule_of"]
