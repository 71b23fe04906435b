"""``PublisherOptions``: every option of a :class:`~vllm_deltasync.trainer.publisher.DeltaPublisher`.

::

    DeltaPublisher(url, anchor_every=5)                               # keywords build the options
    DeltaPublisher(url, PublisherOptions(anchor_every=5, timeout_s=60))
    DeltaPublisher(url, options, resumed_from=3)                      # keywords override them

A new option is one field here (a default, a docstring, a check in ``__post_init__``); the
publisher's constructor takes it without change.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.limits import shown, step_problem
from vllm_deltasync.format.manifest import SCHEMA_VERSION, Manifest
from vllm_deltasync.trainer.lora import MODES

_TOKEN = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class PublisherOptions:
    """How a publisher writes its bucket. Invalid values raise ConfigError naming the option."""

    anchor_every: int = 10
    """Every ``anchor_every``-th publish is an anchor (every parameter)."""
    keep_anchors: int = 2
    """Retention keeps the newest ``keep_anchors`` anchors and what follows them."""
    max_file_bytes: int = 256 << 20
    """Data files are split to stay about this size (at least 1024)."""
    codec: str | None = None
    """Delta encoding: ``sparse-v3`` (None means it, or ``sparse-v2`` with ``format_version=1``:
    entropy-coded gaps and exact bf16 bit-pattern differences, ~1.1-1.3 B per changed element,
    read from 0.3.0), ``sparse-v2`` (~1.6 B, read by 0.2.x), ``sparse-v2-zstd``, or ``sparse-v1``
    (TRL's int32 index + bf16 value layout, 6 B); docs/codec.md."""
    max_pending_steps: int = 2
    """Steps queued for upload before ``publish`` waits."""
    store_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Passed to the store backend (may hold credentials: never shown in a repr)."""
    on_commit: Callable[[Manifest], None] | None = None
    """Called on the upload thread with each committed manifest."""
    timeout_s: float = 600.0
    """Limit in seconds for one store operation seen from the upload thread."""
    run_id: str | None = None
    """The training run (8-64 lowercase hex; random if None). Readers never follow a delta
    chain across runs: give a new one to a run restarted from an earlier checkpoint, the same
    one to a run that continues."""
    writer_token: str | None = None
    """This writer (8-64 lowercase hex; random if None). Every rank of one sharded job passes
    the same token (one job is one writer); a restarted job may pass its previous token to
    clean up its own earlier data. Retention never deletes what another token wrote, and a
    step committed by another token on this prefix stops the publisher with a PublishError."""
    format_version: int = SCHEMA_VERSION
    """3 (default: version 2 with the manifest's tensor table deflated, ~5x smaller; read from
    vllm-deltasync 0.4.0), 2 (for 0.2.x-0.3.x readers) or 1 (for readers older than 0.2.0: no
    writer token, no ranged reads)."""
    resumed_from: int | None = None
    """A trainer restarted from a checkpoint: the training step of that checkpoint (a step
    number: 0 to 10**12 - 1), recorded on the first anchor the publisher commits
    (informative). A new publisher always starts with an anchor after every committed step,
    and servers follow identities (docs/trainer.md, "Restarting a trainer")."""
    previous_on: str = "device"
    """Where the bf16 copy of the last published step lives for parameters on an accelerator:
    ``"device"`` (beside the parameter; only the changed elements are copied to the host) or
    ``"host"`` (the parameters stream through one bounded pinned buffer). CPU parameters always
    diff on the host, in place (docs/trainer.md, "The diff")."""
    encode_threads: int = 0
    """Threads that encode a step's chunks while its files upload (0: one per available core,
    at most 8); the bytes published do not depend on it."""
    lora: str = "merged"
    """What ``publish(step, model)`` takes from a PEFT model (trainer/lora.py): ``"merged"``
    (the weights ``merge_and_unload()`` gives, under the base checkpoint's names) or
    ``"adapter"`` (only the adapter, as ``save_pretrained`` names it, with its configuration
    in every manifest; format version 2 or 3). docs/trainer.md, "LoRA"."""

    def __post_init__(self) -> None:
        for name, low in (("anchor_every", 1), ("keep_anchors", 1), ("max_file_bytes", 1024),
                          ("max_pending_steps", 1), ("encode_threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"DeltaPublisher: {name}={value!r} must be an integer >= {low}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"DeltaPublisher: timeout_s={timeout!r} must be a number of seconds > 0")
        if self.format_version not in (1, 2, 3) or isinstance(self.format_version, bool):
            raise ConfigError(f"DeltaPublisher: format_version={self.format_version!r} must be 3, 2 or 1")
        self._check_codec()
        for label in ("run_id", "writer_token"):
            token = getattr(self, label)
            if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
                raise ConfigError(f"DeltaPublisher: {label}={token!r} must be 8-64 lowercase hex digits")
        resumed = self.resumed_from
        if resumed is not None and (problem := step_problem(resumed)) is not None:
            raise ConfigError(f"DeltaPublisher: resumed_from={shown(resumed)} {problem}; pass "
                              "the training step of the checkpoint the trainer resumed from")
        if self.previous_on not in ("device", "host"):
            raise ConfigError(f"DeltaPublisher: previous_on={self.previous_on!r} must be 'device' "
                              "(the previous step's copy beside each parameter) or 'host'")
        if self.lora not in MODES:
            raise ConfigError(f"DeltaPublisher: lora={self.lora!r} must be 'merged' (a PEFT "
                              "model's merged weights) or 'adapter' (its adapter only)")
        if self.lora == "adapter" and self.format_version < 2:
            raise ConfigError("DeltaPublisher: lora='adapter' needs format_version 2 or 3 (the "
                              "manifest's adapter record); format version 1 has none")
        if self.store_options is not None and not isinstance(self.store_options, Mapping):
            raise ConfigError("DeltaPublisher: store_options must be a mapping of the store "
                              "backend's options (docs/transports.md)")
        if self.on_commit is not None and not callable(self.on_commit):
            raise ConfigError("DeltaPublisher: on_commit must be callable with a Manifest")

    def _check_codec(self) -> None:
        codec = self.delta_codec
        try:
            chosen = get_codec(codec)
        except FormatError as exc:
            raise ConfigError(f"DeltaPublisher: {exc}") from None
        if chosen.dense:
            raise ConfigError(f"codec {codec!r} is dense; deltas need a sparse codec such as 'sparse-v1'")
        if self.format_version == 1 and chosen.min_reader:
            raise ConfigError(f"DeltaPublisher: codec {codec!r} is read from vllm-deltasync "
                              f"{chosen.min_reader}, which reads format version 2; format_version=1 "
                              "(for older readers) needs 'sparse-v2', 'sparse-v2-zstd' or 'sparse-v1'")

    @property
    def delta_codec(self) -> str:
        """The codec deltas are written with: ``codec``, or the format version's default
        (format v1 is for old readers: a codec they read)."""
        if self.codec is not None:
            return self.codec
        return "sparse-v3" if self.format_version >= 2 else "sparse-v2"

    @classmethod
    def build(cls, options: PublisherOptions | None, fields: Mapping[str, Any]) -> PublisherOptions:
        """``options`` (or the defaults) with ``fields`` set; a name that is no option is a
        TypeError, as an unknown keyword argument is."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"DeltaPublisher got unknown option(s) {unknown}; the options are "
                            f"{sorted(known)} (PublisherOptions)")
        if options is None:
            return cls(**fields)
        if not isinstance(options, cls):
            raise TypeError(f"DeltaPublisher: options must be a PublisherOptions, got "
                            f"{type(options).__name__}")
        return dataclasses.replace(options, **fields) if fields else options


__all__ = ["PublisherOptions"]
