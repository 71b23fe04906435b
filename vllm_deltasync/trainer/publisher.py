"""``DeltaPublisher``: the trainer side. One call per optimizer step.

::

    with DeltaPublisher("file:///data/bucket", anchor_every=10) as pub:
        for step in range(steps):
            train_step()
            pub.publish(step, model.named_parameters())

``publish`` compares every parameter's bf16 bit pattern with the one bf16 copy of the last
published weights it keeps, where the parameter lives (trainer/diff.py: on its accelerator, or
in place on the host without a second copy), updates that copy at the changed elements and
queues them (or, for an anchor, every element). A background thread encodes, writes the data files and
then the manifest (the commit point); a bounded queue makes ``publish`` wait instead of
growing memory when uploads fall behind. An error in the background is raised by the next
``publish``/``flush``/``close``; the step after it is then an anchor, so the bucket never
holds a delta whose base was lost. After each anchor, retention deletes what no reader can
need (docs/format.md, "Retention").
"""

from __future__ import annotations

import logging
import math
import queue
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from vllm_deltasync._loop import BackgroundLoop, default_loop
from vllm_deltasync.errors import (
    AlreadyExistsError,
    ConfigError,
    FormatError,
    NotFoundError,
    PublishError,
)
from vllm_deltasync.format._listing import newest_readable, read_manifest, skipped_line
from vllm_deltasync.format.codecs import get_codec
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import (
    SCHEMA_VERSION,
    Kind,
    Manifest,
    Region,
    Totals,
    fingerprint,
)
from vllm_deltasync.format.writer import StepItem, commit_manifest, retain, write_files, write_step
from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.trainer import sharded
from vllm_deltasync.trainer.diff import Diff, Differ

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
    sharded: bool = False
    """One rank's part of a step of a sharded job (trainer/sharded.py)."""
    lease: object = field(default_factory=object)
    """What the diff lent this job (an anchor's host baselines), released when it is done."""


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
        codec: str | None = None,
        max_pending_steps: int = 2,
        store_options: Mapping[str, Any] | None = None,
        on_commit: Callable[[Manifest], None] | None = None,
        timeout_s: float = 600.0,
        run_id: str | None = None,
        writer_token: str | None = None,
        format_version: int = SCHEMA_VERSION,
        resumed_from: int | None = None,
        previous_on: str = "device",
        encode_threads: int = 0,
    ) -> None:
        """
        Args:
            url: bucket URL (``file://``, ``memory://``, ``hf://``, ``s3://``).
            anchor_every: every ``anchor_every``-th publish is an anchor (every parameter).
            keep_anchors: retention keeps the newest ``keep_anchors`` anchors and what follows.
            max_file_bytes: data files are split to stay about this size.
            codec: delta encoding: ``sparse-v3`` (the default since 0.3.0: entropy-coded
                gaps and exact bf16 bit-pattern differences, ~1.1-1.3 B per changed element;
                its manifests need readers >= 0.3.0), ``sparse-v2`` (~1.6 B, read by 0.2.x;
                the default with ``format_version=1``), ``sparse-v2-zstd``, or ``sparse-v1``
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
            format_version: 3 (default: version 2 with the manifest's tensor table deflated,
                ~5x smaller; read from vllm-deltasync 0.4.0), 2 (for 0.2.x-0.3.x readers) or
                1 (for readers older than 0.2.0: no writer token, no ranged reads).
            resumed_from: a trainer restarted from a checkpoint: the training step of that
                checkpoint, recorded on the first anchor this publisher commits (informative).
                The restart flow needs nothing else: a new publisher always starts with an
                anchor, at a step number after every committed one (:attr:`next_step`), and
                servers follow identities, never applying a delta onto other weights
                (docs/trainer.md, "Restarting a trainer").
            previous_on: where the bf16 copy of the last published step lives and the diff
                runs, for parameters on an accelerator: ``"device"`` (default: beside the
                parameter, in device memory; compare and gather run there and only the changed
                elements are copied to the host) or ``"host"`` (host memory; the parameters
                stream through one bounded pinned buffer). CPU parameters always diff on the
                host, in place, without a second copy (docs/trainer.md, "The diff").
            encode_threads: threads that encode a step's chunks while its files upload (0: one
                per available core, at most 8); the bytes published do not depend on it.
        """
        _check_options(anchor_every, keep_anchors, max_file_bytes, max_pending_steps)
        if format_version not in (1, 2, 3):
            raise ConfigError(f"DeltaPublisher: format_version={format_version!r} must be 3, 2 or 1")
        if codec is None:  # format v1 is for old readers: a codec they read
            codec = "sparse-v3" if format_version >= 2 else "sparse-v2"
        try:
            chosen = get_codec(codec)
        except FormatError as exc:
            raise ConfigError(f"DeltaPublisher: {exc}") from exc
        if chosen.dense:
            raise ConfigError(f"codec {codec!r} is dense; deltas need a sparse codec such as 'sparse-v1'")
        if format_version == 1 and chosen.min_reader:
            raise ConfigError(f"DeltaPublisher: codec {codec!r} is read from vllm-deltasync "
                              f"{chosen.min_reader}, which reads format version 2; format_version=1 "
                              "(for older readers) needs 'sparse-v2', 'sparse-v2-zstd' or 'sparse-v1'")
        for label, token in (("run_id", run_id), ("writer_token", writer_token)):
            if token is not None and not re.fullmatch(r"[0-9a-f]{8,64}", token):
                raise ConfigError(f"DeltaPublisher: {label}={token!r} must be 8-64 lowercase hex digits")
        self.format_version = format_version
        if resumed_from is not None and (isinstance(resumed_from, bool)
                                         or not isinstance(resumed_from, int) or resumed_from < 0):
            raise ConfigError(f"DeltaPublisher: resumed_from={resumed_from!r} must be a training "
                              "step (an integer >= 0)")
        self.resumed_from = resumed_from
        if previous_on not in ("device", "host"):
            raise ConfigError(f"DeltaPublisher: previous_on={previous_on!r} must be 'device' (the "
                              "previous step's copy beside each parameter) or 'host'")
        self.previous_on = previous_on
        if isinstance(encode_threads, bool) or not isinstance(encode_threads, int) or encode_threads < 0:
            raise ConfigError(f"DeltaPublisher: encode_threads={encode_threads!r} must be an integer "
                              ">= 0 (0: one per available core, at most 8)")
        self._differ = Differ(previous_on=previous_on)
        self._explicit_tokens = (run_id is not None, writer_token is not None)
        self._group: sharded.RankGroup | None = None
        self.run_id = run_id or secrets.token_hex(8)
        self.writer_token = writer_token or secrets.token_hex(8)
        self.url = url
        self.anchor_every = anchor_every
        self.keep_anchors = keep_anchors
        self.max_file_bytes = max_file_bytes
        self.encode_threads = encode_threads
        self.codec = codec
        self.on_commit = on_commit
        self.timeout_s = timeout_s
        self.stats = PublisherStats()
        self._loop: BackgroundLoop = default_loop()
        self._store: Store = open_store(url, **dict(store_options or {}))
        self._published = False  # a first step was diffed (the differ holds its baselines)
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._last_step: int | None = self._run(self._newest_step())
        self._since_anchor = 0
        self._anchor_step = -1
        self._force_anchor = False
        self._error: BaseException | None = None
        self._failed = False
        self._closed = False
        self._kinds: dict[int, tuple[str, frozenset[str], str | None]] = {}
        self._ids: dict[int, str] = {}
        """Upload thread: identities of the steps this publisher committed (a delta names its
        base's, ``Manifest.base_id``); the last few only."""
        self._seen_step = self._last_step  # newest step checked for another writer
        self._unreadable: set[int] = set()  # newer manifests that do not read: skipped, reported once
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending_steps)
        self._thread = threading.Thread(target=self._work, name="vllm-deltasync-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer-facing API
    def publish(self, step: int, named_tensors: TensorSource) -> None:
        """Queue ``step``; returns once the diff is taken (uploads continue in the background).

        DTensor parameters make the call collective: every rank of the job calls ``publish``
        with the same step and writes only its own shards (docs/trainer.md).
        """
        if self._closed:  # local state: no exchange with the other ranks
            raise PublishError(f"step {step}: the publisher is closed; open a new DeltaPublisher")
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if self._group is not None or sharded.has_dtensor(pairs):
            self._publish_sharded(step, pairs)
            return
        self._raise_background_error()
        self._check_step(step)
        started = time.perf_counter()
        tensors = self._validate(step, pairs)
        job = self._make_job(step, tensors)
        self._last_step = step
        job.diff_s = time.perf_counter() - started
        self.stats.diff_s += job.diff_s
        self._queue.put(job)

    def flush(self) -> None:
        """Wait until every queued step is committed; raise a background error if one happened.

        Sharded: collective (every rank calls it); on the committing rank "committed", on the
        others "their files and part records are written"; an error on any rank raises on all.
        """
        self._queue.join()
        if self._group is not None:
            self._agree(None, None, None)
        self._raise_background_error()

    def close(self) -> None:
        """Commit what is queued, stop the upload thread and release the store (sharded: collective)."""
        self._close(collective=True)

    def _close(self, *, collective: bool) -> None:
        if self._closed:
            return
        group_error: BaseException | None = None
        if self._group is not None and collective and not self._group.broken:
            self._queue.join()
            try:
                self._agree(None, None, None)
            except BaseException as exc:
                group_error = exc
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._differ.close()
        if self._group is not None:
            self._group.close()
        try:
            self._run(self._store.close())
        finally:
            if group_error is not None:
                raise group_error
            self._raise_background_error()

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # leaving on an exception: other ranks may not be here, so no collective
        self._close(collective=exc_type is None)

    def _check_step(self, step: int) -> None:
        if self._closed:
            raise PublishError(f"step {step}: the publisher is closed; open a new DeltaPublisher")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
            raise PublishError(f"step {step!r} must be an integer in [0, 10**12 - 1] (steps are "
                               "named by 12 digits in the bucket)")
        if self._last_step is not None and step <= self._last_step:
            raise PublishError(
                f"step {step}: steps must increase; the newest step of {self._store.url} is "
                f"{self._last_step}. Publish step {self._last_step + 1} or later, or use a new bucket"
            )

    # ------------------------------------------------------------------ sharded (collective)
    def _publish_sharded(self, step: int, pairs: list[tuple[str, torch.Tensor]]) -> None:
        started = time.perf_counter()
        if self._group is None:
            if self._published:
                raise PublishError(f"step {step}: this publisher published plain tensors before; "
                                   "a sharded job publishes DTensors from its first step")
            if self.format_version < 2:
                raise PublishError("a sharded publish needs format_version=2 (chunks in checkpoint "
                                   "coordinates, one writer token per job)")
            group = sharded.RankGroup(2 * self.timeout_s + 60)
            try:
                self.run_id, self.writer_token = group.start(self.run_id, self.writer_token,
                                                             self._explicit_tokens)
            except BaseException:
                group.close()
                raise
            self._group = group
        local_error: BaseException | None = None
        shards: dict[str, sharded.LocalShard] = {}
        meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        fp = None
        try:
            self._check_step(step)
            for name, tensor in pairs:
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise PublishError(f"step {step}: tensor {name!r} is {kind}; only floating-point "
                                       "parameters can be published (leave integer buffers out)")
                if name in meta:
                    raise PublishError(f"step {step}: tensor {name!r} is given twice")
                shards[name] = sharded.describe(name, tensor, self._group.rank)
                meta[name] = (shards[name].shape, tensor.dtype)
            if not meta:
                raise PublishError(f"step {step}: no tensors given; pass model.named_parameters()")
            self._check_same_set(step, meta)
            fp = fingerprint((name, shape, "bfloat16") for name, (shape, _) in meta.items())
            fp += "/" + sharded.placement_digest(shards)  # ranks holding a parameter differently
        except Exception as exc:
            local_error = exc
        self._agree(step, fp, local_error, shards)
        self._meta = meta
        local = {name: s.local for name, s in shards.items() if s.local is not None}
        job = self._make_job(step, local, {name: s.blocks for name, s in shards.items()})
        self._last_step = step
        job.diff_s = time.perf_counter() - started
        self.stats.diff_s += job.diff_s
        self._queue.put(job)

    def _agree(self, step: int | None, fp: str | None, local_error: BaseException | None,
               shards: Mapping[str, sharded.LocalShard] | None = None) -> None:
        """Every rank learns every rank's error, step, parameter set and placements; all raise
        or none does."""
        assert self._group is not None
        own = local_error or self._error
        what = f"step {step}" if step is not None else "flush/close"
        records = self._group.gather((step, fp, None if own is None else f"{type(own).__name__}: {own}"),
                                     what)
        problems = [(r, msg) for r, (_, _, msg) in enumerate(records) if msg]
        placements_only = (step is not None and shards is not None and len({s for s, _, _ in records}) == 1
                           and len({(f or "").split("/")[0] for _, f, _ in records}) == 1)
        if not problems and len({(s, f) for s, f, _ in records}) > 1 and placements_only:
            assert step is not None and shards is not None
            problems = [(-1, sharded.placement_disagreement(self._group, step, shards))]
        if not problems and len({(s, f) for s, f, _ in records}) > 1:
            problems = [(-1, f"the ranks disagree on the step or parameter set: steps "
                             f"{sorted({s for s, _, _ in records if s is not None})}; every rank "
                             "publishes the same step with the same parameter names and shapes")]
        if not problems:
            return
        # everyone: drop what is queued (based on a step that may be lost), anchor next
        self._failed = True
        self._queue.join()
        self._error, self._failed, self._force_anchor = None, False, True
        if own is not None:
            raise own
        rank, msg = problems[0]
        who = "" if rank < 0 else f"rank {rank} failed: "
        raise PublishError(f"{what} (rank {self._group.rank}): not published, {who}{msg}")

    @property
    def next_step(self) -> int:
        """The smallest step number :meth:`publish` takes now: one after the newest step
        published, or after the newest committed in the bucket when this publisher started
        (a restarted trainer publishes there: committed step numbers are never reused)."""
        return 0 if self._last_step is None else self._last_step + 1

    @property
    def last_step(self) -> int | None:
        """The newest step published (queued or committed), or the bucket's newest at start."""
        return self._last_step

    # ------------------------------------------------------------------ diff (caller's thread)
    def _validate(self, step: int, named_tensors: TensorSource) -> dict[str, torch.Tensor]:
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
            snapshot[name] = tensor
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

    def _make_job(self, step: int, tensors: dict[str, torch.Tensor],
                  blocks: Mapping[str, tuple[Region, ...]] | None = None) -> _Job:
        anchor = not self._published or self._force_anchor or self._since_anchor + 1 >= self.anchor_every
        lease = object()
        items: list[StepItem] = []
        cuts = {} if blocks is None else {
            name: tuple(int(c) for c in np.cumsum([r.size for r in blocks[name]])[:-1])
            for name in tensors}
        try:
            diffs = self._differ.diff_all(tensors, full=anchor, job=lease, cuts=cuts)
        except BaseException:
            # some baselines may have moved to this step, which is not queued: the next step
            # must not be a delta computed against them
            self._force_anchor = True
            self._differ.release(lease)
            raise
        for name, diff in diffs.items():
            shape = self._meta[name][0]
            if blocks is None:
                items.append(_item(name, shape, diff))
            else:  # a shard: one item per block, in the local piece's flat order
                items.extend(_block_items(name, shape, diff, blocks[name]))
        self._published = True
        fp = fingerprint((name, shape, "bfloat16") for name, (shape, _) in self._meta.items())
        totals = (len(self._meta), sum(math.prod(shape) for shape, _ in self._meta.values()))
        part_of = blocks is not None
        if anchor:
            self._anchor_step, self._since_anchor, self._force_anchor = step, 0, False
            return _Job(step, "anchor", None, step, fp, totals, items, sharded=part_of, lease=lease)
        self._since_anchor += 1
        return _Job(step, "delta", self._last_step, self._anchor_step, fp, totals,
                    [i for i in items if i.changed], sharded=part_of, lease=lease)

    # ------------------------------------------------------------------ upload thread
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if not self._failed:
                    self._commit(job)
                elif job.sharded:  # dropped: tell the committer not to wait for this rank
                    self._abort(job, "an earlier step failed on this rank; the step was dropped")
            except BaseException as exc:  # surfaced on the caller's next call
                log.error("publishing step=%d to %s failed: %s", job.step if job else -1, self.url, exc)
                self._error, self._failed = exc, True
                if job is not None and job.sharded:
                    self._abort(job, f"{type(exc).__name__}: {exc}")
            finally:
                if job is not None:
                    job.items = []
                    self._differ.release(job.lease)
                self._queue.task_done()

    def _commit(self, job: _Job) -> None:
        started = time.perf_counter()
        v2 = self.format_version >= 2
        if v2 and not job.sharded:
            self._run(self._check_alone(job.step))
        try:
            if job.sharded:
                committed = self._commit_part(job)
                if committed is None:  # not the committing rank: its files and part are written
                    self._count(job, None, time.perf_counter() - started)
                    return
                manifest = committed
            else:
                manifest = write_step(
                    self._store, self._loop, job.step, job.kind, job.base_step, job.anchor_step,
                    job.fingerprint, job.totals, job.items, codec=self.codec,
                    max_file_bytes=self.max_file_bytes, timeout_s=self.timeout_s,
                    version=self.format_version, run_id=self.run_id, writer=self.writer_token,
                    base_id=self._base_id(job), resumed_from=self._resumed_from(job),
                    encode_threads=self.encode_threads,
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
        if manifest.identity is not None:
            self._ids[job.step] = manifest.identity
            while len(self._ids) > 8:
                del self._ids[min(self._ids)]
        tokens = frozenset(f.path.rsplit("/", 1)[0] for f in manifest.files)
        self._kinds[job.step] = (job.kind, tokens, manifest.writer)
        if job.kind == "anchor":
            self._run(retain(self._store, self.keep_anchors, self._kinds,
                             writer=self.writer_token if v2 else None))
        elapsed = time.perf_counter() - started
        self._count(job, manifest, elapsed)
        log.info("committed step=%d kind=%s changed=%d bytes=%d in %.3fs", job.step, job.kind,
                 manifest.totals.changed, manifest.totals.bytes, elapsed)
        if self.on_commit is not None:
            self.on_commit(manifest)

    def _count(self, job: _Job, manifest: Manifest | None, elapsed: float) -> None:
        """Stats of one step: committed (``manifest``), or a part written by a non-committing rank."""
        stats = self.stats
        stats.steps += 1
        stats.anchors += job.kind == "anchor"
        stats.upload_s += elapsed
        stats.per_step.append((job.step, job.diff_s, elapsed))
        if manifest is not None:
            stats.bytes_written += manifest.totals.bytes + len(manifest.to_json())
            stats.last_manifest = manifest

    def _commit_part(self, job: _Job) -> Manifest | None:
        """Sharded: write this rank's files and part record; rank 0 merges and commits."""
        group = self._group
        assert group is not None
        attempt = group.attempt()
        files, tensors = write_files(
            self._store, self._loop, job.step, job.kind, job.items, codec=self.codec,
            max_file_bytes=self.max_file_bytes, timeout_s=self.timeout_s, writer=self.writer_token,
            attempt=attempt, encode_threads=self.encode_threads)
        sharded.failpoint(group.rank, job.step)
        template = Manifest(step=job.step, kind=job.kind, base_step=job.base_step,
                            anchor_step=job.anchor_step, created_at=time.time(),
                            fingerprint=job.fingerprint, files=(), tensors=(),
                            totals=Totals(0, 0, 0, 0), run_id=self.run_id, writer=self.writer_token)
        part = sharded.part_manifest(template, files, tensors)
        folder = sharded.folder(job.step, self.writer_token, attempt)
        self._run(self._store.write(f"{folder}/{sharded.PART_NAME}", part.to_json()))
        if group.rank != 0:
            return None
        parts = self._run(sharded.collect_parts(self._store, job.step, self.writer_token,
                                                group.session, group.world, self.timeout_s))
        manifest = replace(sharded.merge_parts(parts, job.totals), base_id=self._base_id(job),
                           resumed_from=self._resumed_from(job))
        self._run(self._check_alone(job.step))
        return commit_manifest(self._store, self._loop, manifest, self.timeout_s)

    def _base_id(self, job: _Job) -> str | None:
        """Upload thread: the identity of the manifest a delta job was computed from (format
        v2+; v1 has no identities). Its base is always the step this publisher committed
        just before (a failed commit makes the next job an anchor and drops queued deltas)."""
        if job.kind != "delta" or self.format_version < 2:
            return None
        assert job.base_step is not None
        base_id = self._ids.get(job.base_step)
        if base_id is None:
            raise PublishError(f"step {job.step}: its base step {job.base_step} was not committed "
                               "by this publisher; the next step is an anchor")
        return base_id

    def _resumed_from(self, job: _Job) -> int | None:
        """The first anchor of a restarted trainer records the checkpoint it resumed from."""
        if job.kind != "anchor" or self.resumed_from is None or self._ids:
            return None
        return self.resumed_from

    def _abort(self, job: _Job, why: str) -> None:
        """Sharded: this rank will write no part for ``job``; best effort, never raises."""
        if self._group is None:
            return
        path = f"{sharded.folder(job.step, self.writer_token, self._group.attempt())}/{sharded.ABORT_NAME}"
        try:
            self._run(self._store.write(path, why.encode("utf-8"), overwrite=True))
        except Exception as exc:
            log.warning("could not write %s: %s", path, exc)

    async def _writer_of(self, step: int) -> tuple[str, str] | None:
        """``(writer, run_id)`` of the committed manifest of ``step`` (None: absent or v1)."""
        path = manifest_path(step)
        try:
            m = Manifest.from_json(await self._store.read(path), source=path)
        except Exception:  # absent, unreadable: no writer to name
            return None
        return (m.writer, m.run_id or "?") if m.writer else ("(format v1, anonymous)", "?")

    async def _check_alone(self, step: int) -> None:
        """Refuse to commit when a step newer than the last one seen was committed by another writer.

        A newer manifest that does not read (garbage, or another step's) is skipped with one
        warning line, once: it names no writer and is no step to publish after."""
        steps = [parse_manifest_path(o.path) for o in await self._store.list(f"{MANIFEST_DIR}/")]
        candidates = sorted(s for s in steps if s is not None and (self._seen_step is None or s > self._seen_step)
                            and s not in self._kinds and s not in self._unreadable)
        newer = []
        for other_step in candidates:
            try:
                m = await read_manifest(self._store, other_step)
            except (FormatError, NotFoundError) as exc:
                if not isinstance(exc, NotFoundError):  # gone since the listing: nothing to say
                    log.warning("%s", skipped_line(self._store, other_step, exc))
                    self._unreadable.add(other_step)
                continue
            newer.append(other_step)
            other = (m.writer, m.run_id or "?") if m.writer else ("(format v1, anonymous)", "?")
            if other[0] != self.writer_token:
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
        """The newest readable step at start: a garbage newest manifest is skipped with one
        warning line naming it (format/_listing.py), never the step every publish is refused by."""
        newest = await newest_readable(self._store)
        return None if newest is None else newest[0]


def _check_options(anchor_every: int, keep_anchors: int, max_file_bytes: int, pending: int) -> None:
    for name, value, low in (("anchor_every", anchor_every, 1), ("keep_anchors", keep_anchors, 1),
                             ("max_file_bytes", max_file_bytes, 1024), ("max_pending_steps", pending, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"DeltaPublisher: {name}={value!r} must be an integer >= {low}")


def _item(name: str, shape: tuple[int, ...], diff: Diff) -> StepItem:
    return StepItem(name, shape, diff.changed, diff.indices, diff.new, diff.old)


def _block_items(name: str, shape: tuple[int, ...], diff: Diff,
                 regions: tuple[Region, ...]) -> list[StepItem]:
    """One shard's diff (over its local piece, flat) as one item per block, in local indices."""
    items: list[StepItem] = []
    if not regions:  # this rank holds none of the tensor
        return items
    pos = 0
    for region, count in zip(regions, diff.counts, strict=True):
        stop = pos + region.size
        if diff.indices is None:
            item = StepItem(name, shape, count, None, diff.new[pos:stop], None)
        else:
            lo, hi = (int(i) for i in torch.searchsorted(diff.indices, torch.tensor([pos, stop])))
            assert diff.old is not None
            item = StepItem(name, shape, hi - lo, diff.indices[lo:hi] - pos, diff.new[lo:hi],
                            diff.old[lo:hi])
        item.region = region
        items.append(item)
        pos = stop
    return items


__all__ = ["DeltaPublisher", "PublisherStats"]
