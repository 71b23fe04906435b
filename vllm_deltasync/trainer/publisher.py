"""``DeltaPublisher``: the trainer side. One call per optimizer step.

::

    with DeltaPublisher("file:///data/bucket", anchor_every=10) as pub:
        for step in range(steps):
            train_step()
            pub.publish(step, model.named_parameters())

``publish`` rounds every parameter to bf16 on the host, compares its bit pattern with the
one bf16 copy of the last published weights it keeps, and queues the changed elements
(or, for an anchor, every element). A background thread encodes, writes the data files and
then the manifest (the commit point); a bounded queue makes ``publish`` wait instead of
growing memory when uploads fall behind. An error in the background is raised by the next
``publish``/``flush``/``close``; the step after it is then an anchor, so the bucket never
holds a delta whose base was lost. After each anchor, retention deletes what no reader can
need (docs/format.md, "Retention").
"""

from __future__ import annotations

import logging
import queue
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_deltasync._loop import BackgroundLoop, default_loop
from vllm_deltasync.errors import AlreadyExistsError, ConfigError, FormatError, PublishError
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import SCHEMA_VERSION, Kind, Manifest, fingerprint
from vllm_deltasync.format.writer import StepItem, retain, write_step
from vllm_deltasync.stores import Store, open_store

log = logging.getLogger(__name__)

TensorSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class _Job:
    step: int
    kind: Kind
    base_step: int | None
    anchor_step: int
    fingerprint: str
    totals: tuple[int, int]  # tensors, elements of the parameter set
    items: list[StepItem]
    diff_s: float = 0.0


@dataclass
class PublisherStats:
    """What a publisher has done so far (read it after ``flush()``)."""

    steps: int = 0
    """Steps committed."""
    anchors: int = 0
    """Of which anchors."""
    bytes_written: int = 0
    """Data and manifest bytes committed."""
    diff_s: float = 0.0
    """Seconds the training loop spent inside ``publish`` (snapshot + diff)."""
    upload_s: float = 0.0
    """Seconds the background thread spent encoding, writing and retaining."""
    last_manifest: Manifest | None = None
    """Manifest of the newest committed step."""
    per_step: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    """``(step, diff_s, upload_s)`` of the last 4096 committed steps, oldest first."""


class DeltaPublisher:
    """Publish one step per optimizer step to the bucket at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        anchor_every: int = 10,
        keep_anchors: int = 2,
        max_file_bytes: int = 256 << 20,
        codec: str = "sparse-v2",
        max_pending_steps: int = 2,
        store_options: Mapping[str, Any] | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
        timeout_s: float = 600.0,
        run_id: str | None = None,
        writer_token: str | None = None,
        format_version: int = SCHEMA_VERSION,
    ) -> None:
        """
        Args:
            url: bucket URL (``file://``, ``memory://``, ``hf://``, ``s3://``).
            anchor_every: every ``anchor_every``-th publish is an anchor (every parameter).
            keep_anchors: retention keeps the newest ``keep_anchors`` anchors and what follows.
            max_file_bytes: data files are split to stay about this size.
            codec: delta encoding: ``sparse-v2`` (gap-coded positions + exact bf16 bit-pattern
                differences, ~1.6 B per changed element), ``sparse-v2-zstd``, or ``sparse-v1``
                (TRL's int32 index + bf16 value layout, 6 B); docs/codec.md.
            max_pending_steps: steps queued for upload before ``publish`` waits.
            store_options: passed to the store backend.
            on_commit: called on the upload thread with each committed manifest.
            timeout_s: limit for one store operation seen from the upload thread.
            run_id: the training run (8-64 lowercase hex; random if None). Readers never
                follow a delta chain across runs: give a new one to a run restarted from an
                earlier checkpoint, the same one to a run that continues.
            writer_token: this writer (8-64 lowercase hex; random if None). Every rank of one
                sharded job passes the same token (one job is one writer); a restarted job
                may pass its previous token to clean up its own earlier data. Retention never
                deletes what another token wrote, and a step committed by another token on
                this prefix stops this publisher with a PublishError naming it.
            format_version: 2 (default) or 1 (for readers older than vllm-deltasync 0.2.0:
                no writer token, no ranged reads).
        """
        _check_options(anchor_every, keep_anchors, max_file_bytes, max_pending_steps)
        try:
            dense = get_codec(codec).dense
        except FormatError as exc:
            raise ConfigError(f"DeltaPublisher: {exc}") from exc
        if dense:
            raise ConfigError(f"codec {codec!r} is dense; deltas need a sparse codec such as 'sparse-v1'")
        if format_version not in (1, 2):
            raise ConfigError(f"DeltaPublisher: format_version={format_version!r} must be 1 or 2")
        for label, token in (("run_id", run_id), ("writer_token", writer_token)):
            if token is not None and not re.fullmatch(r"[0-9a-f]{8,64}", token):
                raise ConfigError(f"DeltaPublisher: {label}={token!r} must be 8-64 lowercase hex digits")
        self.format_version = format_version
        self.run_id = run_id or secrets.token_hex(8)
        self.writer_token = writer_token or secrets.token_hex(8)
        self.url = url
        self.anchor_every = anchor_every
        self.keep_anchors = keep_anchors
        self.max_file_bytes = max_file_bytes
        self.codec = codec
        self.on_commit = on_commit
        self.timeout_s = timeout_s
        self.stats = PublisherStats()
        self._loop: BackgroundLoop = default_loop()
        self._store: Store = open_store(url, **dict(store_options or {}))
        self._last: dict[str, torch.Tensor] | None = None
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._last_step: int | None = self._run(self._newest_step())
        self._since_anchor = 0
        self._anchor_step = -1
        self._force_anchor = False
        self._error: BaseException | None = None
        self._failed = False
        self._closed = False
        self._kinds: dict[int, tuple[str, frozenset[str], str | None]] = {}
        self._seen_step = self._last_step  # newest step checked for another writer
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending_steps)
        self._thread = threading.Thread(target=self._work, name="vllm-deltasync-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer-facing API
    def publish(self, step: int, named_tensors: TensorSource) -> None:
        """Queue ``step``; returns once the diff is taken (uploads continue in the background)."""
        self._raise_background_error()
        if self._closed:
            raise PublishError(f"step {step}: the publisher is closed; open a new DeltaPublisher")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PublishError(f"step {step!r} must be a non-negative integer")
        if self._last_step is not None and step <= self._last_step:
            raise PublishError(
                f"step {step}: steps must increase; the newest step of {self._store.url} is "
                f"{self._last_step}. Publish step {self._last_step + 1} or later, or use a new bucket"
            )
        started = time.perf_counter()
        snapshot = self._snapshot(step, named_tensors)
        job = self._make_job(step, snapshot)
        self._last, self._last_step = snapshot, step
        job.diff_s = time.perf_counter() - started
        self.stats.diff_s += job.diff_s
        self._queue.put(job)

    def flush(self) -> None:
        """Wait until every queued step is committed; raise a background error if one happened."""
        self._queue.join()
        self._raise_background_error()

    def close(self) -> None:
        """Commit what is queued, stop the upload thread and release the store."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        try:
            self._run(self._store.close())
        finally:
            self._raise_background_error()

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_step(self) -> int | None:
        """The newest step published (queued or committed), or the bucket's newest at start."""
        return self._last_step

    # ------------------------------------------------------------------ diff (caller's thread)
    def _snapshot(self, step: int, named_tensors: TensorSource) -> dict[str, torch.Tensor]:
        pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        snapshot: dict[str, torch.Tensor] = {}
        meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, tensor in pairs:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise PublishError(
                    f"step {step}: tensor {name!r} is {kind}; only floating-point parameters can "
                    "be published (leave integer buffers out)"
                )
            if name in snapshot:
                raise PublishError(f"step {step}: tensor {name!r} is given twice")
            snapshot[name] = _to_host_bf16(tensor)
            meta[name] = (tuple(tensor.shape), tensor.dtype)
        if not snapshot:
            raise PublishError(f"step {step}: no tensors given; pass model.named_parameters()")
        self._check_same_set(step, meta)
        self._meta = meta
        return snapshot

    def _check_same_set(self, step: int, meta: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        if not self._meta:
            return
        old = self._meta
        missing, new = sorted(set(old) - set(meta)), sorted(set(meta) - set(old))
        if missing or new:
            raise PublishError(
                f"step {step}: the parameter set changed since step {self._last_step} (missing: "
                f"{missing[:5]}, new: {new[:5]}); publish the same parameters every step, or use "
                "a new bucket for a new model"
            )
        for name, (shape, dtype) in meta.items():
            old_shape, old_dtype = old[name]
            if shape != old_shape or dtype != old_dtype:
                raise PublishError(
                    f"step {step}: tensor {name!r} is {dtype} {list(shape)}, it was {old_dtype} "
                    f"{list(old_shape)} at step {self._last_step}; a parameter's shape and dtype "
                    "must not change within a bucket"
                )

    def _make_job(self, step: int, snapshot: dict[str, torch.Tensor]) -> _Job:
        last = self._last
        anchor = last is None or self._force_anchor or self._since_anchor + 1 >= self.anchor_every
        items = [_diff(name, self._meta[name][0], new, None if last is None else last[name], anchor)
                 for name, new in snapshot.items()]
        fp = fingerprint((name, shape, "bfloat16") for name, (shape, _) in self._meta.items())
        totals = (len(snapshot), sum(t.numel() for t in snapshot.values()))
        if anchor:
            self._anchor_step, self._since_anchor, self._force_anchor = step, 0, False
            return _Job(step, "anchor", None, step, fp, totals, items)
        self._since_anchor += 1
        return _Job(step, "delta", self._last_step, self._anchor_step, fp, totals,
                    [i for i in items if i.changed])

    # ------------------------------------------------------------------ upload thread
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if not self._failed:
                    self._commit(job)
            except BaseException as exc:  # surfaced on the caller's next call
                log.error("publishing step=%d to %s failed: %s", job.step if job else -1, self.url, exc)
                self._error, self._failed = exc, True
            finally:
                self._queue.task_done()

    def _commit(self, job: _Job) -> None:
        started = time.perf_counter()
        v2 = self.format_version >= 2
        if v2:
            self._run(self._check_alone(job.step))
        try:
            manifest = write_step(
                self._store, self._loop, job.step, job.kind, job.base_step, job.anchor_step,
                job.fingerprint, job.totals, job.items, codec=self.codec,
                max_file_bytes=self.max_file_bytes, timeout_s=self.timeout_s,
                version=self.format_version, run_id=self.run_id, writer=self.writer_token,
            )
        except AlreadyExistsError as exc:
            other = self._run(self._writer_of(job.step)) if v2 else None
            raise PublishError(self._conflict(job.step, other) if other else (
                f"step {job.step}: its manifest already exists in {self._store.url}; another "
                "writer publishes to this prefix")) from exc
        if v2:  # hf:// has no atomic create: read the commit back to see who won a race
            other = self._run(self._writer_of(job.step))
            if other is not None and other[0] != self.writer_token:
                raise PublishError(self._conflict(job.step, other))
        self._seen_step = job.step
        tokens = frozenset(f.path.rsplit("/", 1)[0] for f in manifest.files)
        self._kinds[job.step] = (job.kind, tokens, manifest.writer)
        if job.kind == "anchor":
            self._run(retain(self._store, self.keep_anchors, self._kinds,
                             writer=self.writer_token if v2 else None))
        elapsed = time.perf_counter() - started
        stats = self.stats
        stats.steps += 1
        stats.anchors += job.kind == "anchor"
        stats.bytes_written += manifest.totals.bytes + len(manifest.to_json())
        stats.upload_s += elapsed
        stats.last_manifest = manifest
        stats.per_step.append((job.step, job.diff_s, elapsed))
        log.info("committed step=%d kind=%s changed=%d bytes=%d in %.3fs", job.step, job.kind,
                 manifest.totals.changed, manifest.totals.bytes, elapsed)
        if self.on_commit is not None:
            self.on_commit(manifest)

    async def _writer_of(self, step: int) -> tuple[str, str] | None:
        """``(writer, run_id)`` of the committed manifest of ``step`` (None: absent or v1)."""
        path = manifest_path(step)
        try:
            m = Manifest.from_json(await self._store.read(path), source=path)
        except Exception:  # absent, unreadable: no writer to name
            return None
        return (m.writer, m.run_id or "?") if m.writer else ("(format v1, anonymous)", "?")

    async def _check_alone(self, step: int) -> None:
        """Refuse to commit when a step newer than the last one seen was committed by another writer."""
        steps = [parse_manifest_path(o.path) for o in await self._store.list(f"{MANIFEST_DIR}/")]
        newer = sorted(s for s in steps if s is not None and (self._seen_step is None or s > self._seen_step)
                       and s not in self._kinds)
        for other_step in newer:
            other = await self._writer_of(other_step)
            if other is not None and other[0] != self.writer_token:
                raise PublishError(self._conflict(other_step, other))
        if newer and newer[-1] >= step:
            raise PublishError(f"step {step}: step {newer[-1]} is already committed in "
                               f"{self._store.url}; another writer publishes to this prefix")

    def _conflict(self, step: int, other: tuple[str, str]) -> str:
        return (f"a second writer publishes to {self._store.url}: step {step} was committed by "
                f"writer {other[0]} (run {other[1]}); this publisher is writer "
                f"{self.writer_token} (run {self.run_id}). Stop one of them or give each its "
                "own prefix; every rank of one sharded job must pass the same writer_token")

    def _raise_background_error(self) -> None:
        if self._error is None:
            return
        self._queue.join()  # let queued steps (based on the failed one) be discarded
        error, self._error = self._error, None
        self._failed, self._force_anchor = False, True
        raise error

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.timeout_s)

    async def _newest_step(self) -> int | None:
        steps = [parse_manifest_path(o.path) for o in await self._store.list(f"{MANIFEST_DIR}/")]
        found = [s for s in steps if s is not None]
        return max(found) if found else None


def _check_options(anchor_every: int, keep_anchors: int, max_file_bytes: int, pending: int) -> None:
    for name, value, low in (("anchor_every", anchor_every, 1), ("keep_anchors", keep_anchors, 1),
                             ("max_file_bytes", max_file_bytes, 1024), ("max_pending_steps", pending, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"DeltaPublisher: {name}={value!r} must be an integer >= {low}")


def _to_host_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """A private flat bf16 CPU copy of ``tensor``."""
    src = tensor.detach()
    if src.device.type == "cpu" and src.dtype == torch.bfloat16:  # numpy copies without threads
        bits = src.contiguous().view(torch.int16).numpy().reshape(-1).copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    return src.to(torch.bfloat16).to("cpu").contiguous().view(-1)


def _diff(name: str, shape: tuple[int, ...], new: torch.Tensor, old: torch.Tensor | None,
          anchor: bool) -> StepItem:
    """Compare bit patterns (numpy: several times faster than torch on small CPUs)."""
    if old is None:
        return StepItem(name, shape, new.numel(), None, new, None)
    new_bits, old_bits = new.view(torch.int16).numpy(), old.view(torch.int16).numpy()
    changed = new_bits != old_bits
    if anchor:
        return StepItem(name, shape, int(np.count_nonzero(changed)), None, new, None)
    where = np.flatnonzero(changed)
    return StepItem(name, shape, int(where.size), torch.from_numpy(where),
                    torch.from_numpy(new_bits[where]).view(torch.bfloat16),
                    torch.from_numpy(old_bits[where]).view(torch.bfloat16))


__all__ = ["DeltaPublisher", "PublisherStats"]
