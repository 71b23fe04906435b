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
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from vllm_deltasync._loop import BackgroundLoop, default_loop
from vllm_deltasync.errors import PublishError
from vllm_deltasync.format._listing import newest_readable
from vllm_deltasync.format.adapter import AdapterInfo
from vllm_deltasync.format.limits import (
    MAX_NAME_CHARS,
    name_problem,
    shape_problem,
    shown,
    step_problem,
)
from vllm_deltasync.format.manifest import Region, fingerprint
from vllm_deltasync.format.writer import StepFacts, StepItem, shifted
from vllm_deltasync.stores import Store, open_store
from vllm_deltasync.trainer import lora as lora_modes
from vllm_deltasync.trainer import sharded
from vllm_deltasync.trainer.diff import Diff, Differ
from vllm_deltasync.trainer.options import PublisherOptions
from vllm_deltasync.trainer.uploader import PublisherStats, Uploader, UploadJob

log = logging.getLogger(__name__)

TensorSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class DeltaPublisher:
    """Publish one step per optimizer step to the bucket at ``url``.

    ``options`` (:class:`~vllm_deltasync.trainer.options.PublisherOptions`, every option
    documented there) or keyword options, which override those of ``options``::

        DeltaPublisher(url, anchor_every=5, resumed_from=3)
        DeltaPublisher(url, PublisherOptions(anchor_every=5), timeout_s=60)

    An invalid option raises ConfigError naming it, before the store is opened.
    """

    def __init__(self, url: str, options: PublisherOptions | None = None, /, **fields: Any) -> None:
        self.options = options = PublisherOptions.build(options, fields)
        self.url = url
        self.codec = options.delta_codec
        self.stats = PublisherStats()
        self._differ = Differ(previous_on=options.previous_on)
        self._group: sharded.RankGroup | None = None
        self._loop: BackgroundLoop = default_loop()
        self._store: Store = open_store(url, **dict(options.store_options or {}))
        self._published = False  # a first step was diffed (the differ holds its baselines)
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._set_facts: tuple[dict[str, Any], str, tuple[int, int]] | None = None
        self._last_step: int | None = self._run(self._newest_step())
        self._since_anchor = 0
        self._anchor_step = -1
        self._force_anchor = False
        self._adapter: AdapterInfo | None = None  # the adapter of the last step (lora="adapter")
        self._closed = False
        self._uploader = Uploader(self._store, self._loop, options, self.stats, self._differ.release,
                                  run_id=options.run_id or secrets.token_hex(8),
                                  writer_token=options.writer_token or secrets.token_hex(8),
                                  seen_step=self._last_step)

    @property
    def run_id(self) -> str:
        """The training run this publisher writes (given, random, or a sharded job's rank 0's)."""
        return self._uploader.run_id

    @property
    def writer_token(self) -> str:
        """This writer's token (given, random, or a sharded job's rank 0's)."""
        return self._uploader.writer_token

    # ------------------------------------------------------------------ trainer-facing API
    def publish(self, step: int, named_tensors: TensorSource | torch.nn.Module) -> None:
        """Queue ``step``; returns once the diff is taken (uploads continue in the background).

        ``named_tensors``: ``(name, tensor)`` pairs or a mapping, or a module: its
        ``named_parameters()``, and for a PEFT model what the ``lora`` option says
        (trainer/lora.py). DTensor parameters make the call collective: every rank of the job
        calls ``publish`` with the same step and writes only its own shards (docs/trainer.md).
        """
        if self._closed:  # local state: no exchange with the other ranks
            raise PublishError(f"step {step}: the publisher is closed; open a new DeltaPublisher")
        pairs, adapter = lora_modes.published_tensors(step, named_tensors, self.options.lora)
        if self._group is not None or sharded.has_dtensor(pairs):
            self._publish_sharded(step, pairs)
            return
        self._raise_background_error()
        self._check_step(step)
        started = time.perf_counter()
        if adapter != self._adapter:  # another adapter (rank, targets, alpha): a new anchor
            self._meta, self._force_anchor = {}, True
            self._differ.clear()
        tensors = self._validate(step, pairs)
        job = self._make_job(step, tensors, adapter=adapter)
        self._adapter = adapter
        self._last_step = step
        job.diff_s = time.perf_counter() - started
        self.stats.diff_s += job.diff_s
        self._uploader.put(job)

    def flush(self) -> None:
        """Wait until every queued step is committed; raise a background error if one happened.

        Sharded: collective (every rank calls it); on the committing rank "committed", on the
        others "their files and part records are written"; an error on any rank raises on all.
        """
        self._uploader.join()
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
            self._uploader.join()
            try:
                self._agree(None, None, None)
            except BaseException as exc:
                group_error = exc
        self._closed = True
        self._uploader.stop()
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
        if step_problem(step) is not None:
            raise PublishError(f"step {shown(step)} must be an integer in [0, 10**12 - 1] (steps "
                               "are named by 12 digits in the bucket)")
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
            if self.options.format_version < 2:
                raise PublishError("a sharded publish needs format_version=2 (chunks in checkpoint "
                                   "coordinates, one writer token per job)")
            group = sharded.RankGroup(2 * self.options.timeout_s + 60)
            up = self._uploader
            explicit = (self.options.run_id is not None, self.options.writer_token is not None)
            try:
                up.identify(*group.start(up.run_id, up.writer_token, explicit))
            except BaseException:
                group.close()
                raise
            self._group = up.group = group
        local_error: BaseException | None = None
        shards: dict[str, sharded.LocalShard] = {}
        meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        fp = None
        try:
            self._check_step(step)
            for name, tensor in pairs:
                _check_tensor(step, name, tensor)
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
        self._uploader.put(job)

    def _agree(self, step: int | None, fp: str | None, local_error: BaseException | None,
               shards: Mapping[str, sharded.LocalShard] | None = None) -> None:
        """Every rank learns every rank's error, step, parameter set and placements; all raise
        or none does."""
        assert self._group is not None
        own = local_error or self._uploader.error
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
        self._uploader.drop_queued()
        self._force_anchor = True
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
            _check_tensor(step, name, tensor)
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
                  blocks: Mapping[str, tuple[Region, ...]] | None = None, *,
                  adapter: AdapterInfo | None = None) -> UploadJob:
        anchor = not self._published or self._force_anchor or self._since_anchor + 1 >= self.options.anchor_every
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
        fp, totals = self._parameter_set()
        part_of = blocks is not None
        if anchor:
            self._anchor_step, self._since_anchor, self._force_anchor = step, 0, False
            return UploadJob(StepFacts(step, "anchor", None, step, fp, totals, adapter=adapter),
                             items, sharded=part_of, lease=lease)
        self._since_anchor += 1
        facts = StepFacts(step, "delta", self._last_step, self._anchor_step, fp, totals, adapter=adapter)
        return UploadJob(facts, [i for i in items if i.changed], sharded=part_of, lease=lease)

    def _raise_background_error(self) -> None:
        error = self._uploader.take_error()  # queued steps (based on the failed one) are dropped
        if error is not None:
            self._force_anchor = True
            raise error

    def _run(self, coro: Any) -> Any:
        return self._loop.run(coro, self.options.timeout_s)

    async def _newest_step(self) -> int | None:
        """The newest readable step at start: a garbage newest manifest is skipped with one
        warning line naming it (format/_listing.py), never the step every publish is refused by."""
        newest = await newest_readable(self._store)
        return None if newest is None else newest[0]


    def _parameter_set(self) -> tuple[str, tuple[int, int]]:
        """The fingerprint and totals of the parameter set (kept while it stays the same)."""
        if self._set_facts is None or self._set_facts[0] != self._meta:
            fp = fingerprint((name, shape, "bfloat16") for name, (shape, _) in self._meta.items())
            totals = (len(self._meta), sum(math.prod(shape) for shape, _ in self._meta.values()))
            self._set_facts = (dict(self._meta), fp, totals)
        return self._set_facts[1], self._set_facts[2]


def _check_tensor(step: int, name: str, tensor: torch.Tensor) -> None:
    """A floating-point tensor whose name and shape every reader reads (``format/limits.py``);
    PublishError naming it and the fix otherwise."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise PublishError(f"step {step}: tensor {name!r} is {kind}; only floating-point "
                           "parameters can be published (leave integer buffers out)")
    problem = name_problem(name)
    fix = (f"publish it under a name of 1 to {MAX_NAME_CHARS} characters without NUL"
           if problem else "reshape it (at most 8 dimensions) or leave it out")
    problem = problem or shape_problem(tuple(tensor.shape))
    if problem is not None:
        raise PublishError(f"step {step}: tensor {str(name)[:80]!r} {problem}, which no reader "
                           f"reads; nothing of step {step} was published: {fix}")


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
            item = StepItem(name, shape, hi - lo, shifted(diff.indices[lo:hi], pos), diff.new[lo:hi],
                            diff.old[lo:hi])
        item.region = region
        items.append(item)
        pos = stop
    return items


__all__ = ["DeltaPublisher", "PublisherOptions", "PublisherStats"]
