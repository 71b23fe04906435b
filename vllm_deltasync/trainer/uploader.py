"""``Uploader``: the publisher's upload thread and everything only it touches.

The training loop hands it one :class:`UploadJob` per step through a bounded queue. The thread
encodes and writes the step's data files, then its manifest (the commit point), checks that no
other writer publishes to the prefix, runs retention after each anchor and calls
``on_commit``. An error is kept for the caller's next ``publish``/``flush``/``close``
(:meth:`Uploader.take_error`); jobs queued behind a failed one are dropped, since their base
may be lost.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_deltasync._loop import BackgroundLoop
from vllm_deltasync.errors import AlreadyExistsError, FormatError, NotFoundError, PublishError
from vllm_deltasync.format._listing import read_manifest, skipped_line
from vllm_deltasync.format.layout import MANIFEST_DIR, manifest_path, parse_manifest_path
from vllm_deltasync.format.manifest import Kind, Manifest, Totals, manifest_identity
from vllm_deltasync.format.retention import retain
from vllm_deltasync.format.writer import (
    StepFacts,
    StepItem,
    WriteOptions,
    commit_manifest,
    commit_step,
    encode_threads_for,
    write_files,
)
from vllm_deltasync.stores import Store
from vllm_deltasync.trainer import sharded
from vllm_deltasync.trainer.options import PublisherOptions

log = logging.getLogger(__name__)


@dataclass
class UploadJob:
    """One step, diffed on the caller's thread, for the upload thread to write and commit."""

    facts: StepFacts
    """The step's manifest fields (``base_id`` and ``resumed_from`` are added at commit)."""
    items: list[StepItem]
    diff_s: float = 0.0
    sharded: bool = False
    """One rank's part of a step of a sharded job (trainer/sharded.py)."""
    lease: object = field(default_factory=object)
    """What the diff lent this job (an anchor's host baselines), released when it is done."""

    @property
    def step(self) -> int:
        return self.facts.step

    @property
    def kind(self) -> Kind:
        return self.facts.kind


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


class Uploader:
    """The upload thread of one publisher (started by the constructor)."""

    def __init__(self, store: Store, loop: BackgroundLoop, options: PublisherOptions,
                 stats: PublisherStats, release: Callable[[object], None], *,
                 run_id: str, writer_token: str, seen_step: int | None) -> None:
        self.store, self.loop, self.options, self.stats = store, loop, options, stats
        self.run_id, self.writer_token = run_id, writer_token
        self.write_options = self._write_options()
        self.group: sharded.RankGroup | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._release = release
        self._error: BaseException | None = None
        self._failed = False
        self._kinds: dict[int, tuple[str, frozenset[str], str | None]] = {}
        self._ids: dict[int, str] = {}
        """Identities of the steps this publisher committed (a delta names its base's,
        ``Manifest.base_id``); the last few only."""
        self._seen_step = seen_step  # newest step checked for another writer
        self._unreadable: set[int] = set()  # newer manifests that do not read: skipped, reported once
        self._queue: queue.Queue[UploadJob | None] = queue.Queue(maxsize=options.max_pending_steps)
        self._thread = threading.Thread(target=self._work, name="vllm-deltasync-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller's thread
    def identify(self, run_id: str, writer_token: str) -> None:
        """Write as ``run_id`` / ``writer_token`` (a sharded job's agreed ones); before the
        first job only."""
        self.run_id, self.writer_token = run_id, writer_token
        self.write_options = self._write_options()

    def _write_options(self) -> WriteOptions:
        o = self.options
        return WriteOptions(o.delta_codec, o.max_file_bytes, o.timeout_s, o.format_version,
                            self.run_id, self.writer_token, o.encode_threads)

    def put(self, job: UploadJob) -> None:
        """Queue ``job``; waits while ``max_pending_steps`` jobs are queued."""
        self._queue.put(job)

    def join(self) -> None:
        """Wait until every queued job is committed or dropped."""
        self._queue.join()

    @property
    def error(self) -> BaseException | None:
        """The background error not yet taken, if any."""
        return self._error

    def take_error(self) -> BaseException | None:
        """The background error (once), after the jobs queued behind it were dropped."""
        if self._error is None:
            return None
        self._queue.join()
        error, self._error = self._error, None
        self._failed = False
        return error

    def drop_queued(self) -> None:
        """Drop every queued job (their base may be lost) and forget the error."""
        self._failed = True
        self._queue.join()
        self._error, self._failed = None, False

    def stop(self) -> None:
        """Commit what is queued, then end the thread (and the encode pool)."""
        self._queue.put(None)
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

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
                log.error("publishing step=%d to %s failed: %s", job.step if job else -1,
                          self.store.url, exc)
                self._error, self._failed = exc, True
                if job is not None and job.sharded:
                    self._abort(job, f"{type(exc).__name__}: {exc}")
            finally:
                if job is not None:
                    job.items = []
                    self._release(job.lease)
                self._queue.task_done()

    def _commit(self, job: UploadJob) -> None:
        started = time.perf_counter()
        v2 = self.options.format_version >= 2
        size = None
        try:
            if job.sharded:
                manifest = self._commit_part(job)
            else:
                manifest, size = self._write_step(job, v2)
        except AlreadyExistsError as exc:
            other = self._run(self._writer_of(job.step)) if v2 else None
            raise PublishError(self._conflict(job.step, other) if other else (
                f"step {job.step}: its manifest already exists in {self.store.url}; another "
                "writer publishes to this prefix")) from exc
        if manifest is None:  # not the committing rank: its files and part are written
            self._count(job, None, time.perf_counter() - started)
            return
        if v2 and not self.store.create_is_atomic:  # hf://: read the commit back to see who won a race
            other = self._run(self._writer_of(job.step, unless=manifest.identity))
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
            self._run(retain(self.store, self.options.keep_anchors, self._kinds,
                             writer=self.writer_token if v2 else None))
        elapsed = time.perf_counter() - started
        self._count(job, manifest, elapsed, size)
        log.info("committed step=%d kind=%s changed=%d bytes=%d in %.3fs", job.step, job.kind,
                 manifest.totals.changed, manifest.totals.bytes, elapsed)
        if self.options.on_commit is not None:
            self.options.on_commit(manifest)

    def _write_step(self, job: UploadJob, v2: bool) -> tuple[Manifest, int]:
        """Encode, write and commit ``job``; the second-writer check (v2) runs on the loop
        meanwhile and must pass before any file is written."""
        facts = replace(job.facts, base_id=self._base_id(job), resumed_from=self._resumed_from(job))
        gate = self.loop.submit(self._check_alone(job.step)) if v2 else None
        try:
            return commit_step(self.store, self.loop, facts, job.items, self.write_options,
                               executor=self._encoders(), gate=gate)
        finally:
            if gate is not None:  # ended before this job's state is touched again
                with contextlib.suppress(BaseException):
                    gate.result(self.options.timeout_s)

    def _encoders(self) -> ThreadPoolExecutor:
        """The pool that encodes chunks, made at the first step and kept (upload thread)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(encode_threads_for(self.options.encode_threads),
                                            thread_name_prefix="deltasync-encode")
        return self._pool

    def _count(self, job: UploadJob, manifest: Manifest | None, elapsed: float,
               size: int | None = None) -> None:
        """Stats of one step: committed (``manifest``, ``size`` bytes of it where known), or a
        part written by a non-committing rank."""
        stats = self.stats
        stats.steps += 1
        stats.anchors += job.kind == "anchor"
        stats.upload_s += elapsed
        stats.per_step.append((job.step, job.diff_s, elapsed))
        if manifest is not None:
            stats.bytes_written += manifest.totals.bytes + (size or len(manifest.to_json()))
            stats.last_manifest = manifest

    def _commit_part(self, job: UploadJob) -> Manifest | None:
        """Sharded: write this rank's files and part record; rank 0 merges and commits."""
        group, o = self.group, self.options
        assert group is not None
        attempt = group.attempt()
        files, tensors = write_files(self.store, self.loop, job.facts, job.items, self.write_options,
                                     attempt=attempt, executor=self._encoders())
        sharded.failpoint(group.rank, job.step)
        facts = job.facts
        template = Manifest(step=facts.step, kind=facts.kind, base_step=facts.base_step,
                            anchor_step=facts.anchor_step, created_at=time.time(),
                            fingerprint=facts.fingerprint, files=(), tensors=(),
                            totals=Totals(0, 0, 0, 0), run_id=self.run_id, writer=self.writer_token)
        part = sharded.part_manifest(template, files, tensors)
        folder = sharded.folder(job.step, self.writer_token, attempt)
        self._run(self.store.write(f"{folder}/{sharded.PART_NAME}", part.to_json()))
        if group.rank != 0:
            return None
        parts = self._run(sharded.collect_parts(self.store, job.step, self.writer_token,
                                                group.session, group.world, o.timeout_s))
        manifest = replace(sharded.merge_parts(parts, facts.totals), base_id=self._base_id(job),
                           resumed_from=self._resumed_from(job))
        self._run(self._check_alone(job.step))
        return commit_manifest(self.store, self.loop, manifest, o.timeout_s)

    def _base_id(self, job: UploadJob) -> str | None:
        """The identity of the manifest a delta job was computed from (format v2+; v1 has no
        identities). Its base is always the step this publisher committed just before (a
        failed commit makes the next job an anchor and drops queued deltas)."""
        if job.kind != "delta" or self.options.format_version < 2:
            return None
        base_step = job.facts.base_step
        assert base_step is not None
        base_id = self._ids.get(base_step)
        if base_id is None:
            raise PublishError(f"step {job.step}: its base step {base_step} was not committed "
                               "by this publisher; the next step is an anchor")
        return base_id

    def _resumed_from(self, job: UploadJob) -> int | None:
        """The first anchor of a restarted trainer records the checkpoint it resumed from."""
        if job.kind != "anchor" or self.options.resumed_from is None or self._ids:
            return None
        return self.options.resumed_from

    def _abort(self, job: UploadJob, why: str) -> None:
        """Sharded: this rank will write no part for ``job``; best effort, never raises."""
        if self.group is None:
            return
        path = f"{sharded.folder(job.step, self.writer_token, self.group.attempt())}/{sharded.ABORT_NAME}"
        try:
            self._run(self.store.write(path, why.encode("utf-8"), overwrite=True))
        except Exception as exc:
            log.warning("could not write %s: %s", path, exc)

    async def _writer_of(self, step: int, unless: str | None = None) -> tuple[str, str] | None:
        """``(writer, run_id)`` of the committed manifest of ``step``, read back; None when it is
        absent or unreadable (no writer to name), or when its bytes are those of the identity
        ``unless`` (the commit this publisher made: it won)."""
        path = manifest_path(step)
        try:
            data = await self.store.read(path)
        except Exception:  # absent, unreadable: no writer to name
            return None
        if unless is not None and manifest_identity(data) == unless:
            return None
        try:
            return _written_by(Manifest.from_json(data, source=path))
        except Exception:
            return None

    async def _check_alone(self, step: int) -> None:
        """Refuse to commit when a step newer than the last one seen was committed by another writer.

        A newer manifest that does not read (garbage, or another step's) is skipped with one
        warning line, once: it names no writer and is no step to publish after."""
        steps = [parse_manifest_path(o.path) for o in await self.store.list(f"{MANIFEST_DIR}/")]
        candidates = sorted(s for s in steps if s is not None and (self._seen_step is None or s > self._seen_step)
                            and s not in self._kinds and s not in self._unreadable)
        newer = []
        for other_step in candidates:
            try:
                m = await read_manifest(self.store, other_step)
            except (FormatError, NotFoundError) as exc:
                if not isinstance(exc, NotFoundError):  # gone since the listing: nothing to say
                    log.warning("%s", skipped_line(self.store, other_step, exc))
                    self._unreadable.add(other_step)
                continue
            newer.append(other_step)
            other = _written_by(m)
            if other[0] != self.writer_token:
                raise PublishError(self._conflict(other_step, other))
        if newer and newer[-1] >= step:
            raise PublishError(f"step {step}: step {newer[-1]} is already committed in "
                               f"{self.store.url}; another writer publishes to this prefix")

    def _conflict(self, step: int, other: tuple[str, str]) -> str:
        return (f"a second writer publishes to {self.store.url}: step {step} was committed by "
                f"writer {other[0]} (run {other[1]}); this publisher is writer "
                f"{self.writer_token} (run {self.run_id}). Stop one of them or give each its "
                "own prefix; every rank of one sharded job must pass the same writer_token")

    def _run(self, coro: Any) -> Any:
        return self.loop.run(coro, self.options.timeout_s)


def _written_by(m: Manifest) -> tuple[str, str]:
    """``(writer, run_id)`` a manifest names (format v1 names none)."""
    return (m.writer, m.run_id or "?") if m.writer else ("(format v1, anonymous)", "?")


__all__ = ["PublisherStats", "UploadJob", "Uploader"]
