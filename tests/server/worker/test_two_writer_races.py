"""Two writers racing on one prefix of a network bucket (issue 23): hf:// (the local Hub server)
and s3:// (moto, with and without conditional writes). A rank in the race window never
applies a step across writers; a publisher that loses a race it can see is told so; where the
store cannot make the commit conditional, readers refuse the loser's steps.

The race window is placed deterministically. The other writer (B) publishes for real into a
scratch bucket on the same server; its data files (named by its writer token) and, at the
moment of the race, its manifests are written into the contested bucket. Against a running
``DeltaPublisher`` the other commit lands inside that publisher's own commit, through the
transport: the Hub store's ``uploader`` seam (the one hf:// tests always use), and a botocore
event hook on the S3 client (before the manifest's PUT: after the store's existence check;
after it: before the publisher reads its commit back). Everything else is the real code
against the real servers: the poller and the rank's chain check (``Follower``), the reader,
the publisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.helpers.follow import Follower, Weights, clone, publish_steps, seeded_weights, train
from tests.helpers.transports import S3_CREDENTIALS
from tests.helpers.waiting import wait_until
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import ChainError, PublishError
from vllm_deltasync.format.layout import manifest_path, parse_data_path
from vllm_deltasync.format.manifest import Manifest, manifest_identity
from vllm_deltasync.format.reader import BucketReader, short_id
from vllm_deltasync.stores import Store

A, RUN_A = "aaaa0000aaaa0000", "00000000000000a1"
B, RUN_B = "bbbb1111bbbb1111", "00000000000000b2"


# -- buckets on the two servers -------------------------------------------------------------


@dataclass
class Rival:
    """The other writer's commit of one step, landing inside a publisher's commit of it:
    ``before`` its manifest PUT (after the existence check) or ``after`` it (before the
    read-back)."""

    path: str
    data: bytes
    when: str
    landed: bool = False
    own: bytes | None = None
    """What the racing publisher itself PUT under ``path``."""


@dataclass
class Site:
    """One bucket of a real server and how each party reaches it."""

    kind: str
    store: Store  # the fixture's store, on the test's event loop
    run: Callable[..., Any]
    publisher_options: dict[str, Any]
    reader_options: dict[str, Any]

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def follow(self) -> dict[str, Any]:
        """A follower's options: the store's, and a poll interval a discovery round fits in
        (the watcher cancels a round that outlasts it; a first S3 client takes ~0.1-0.4 s)."""
        return {"store_options": self.reader_options, "poll_interval_s": 0.2}

    def paths(self) -> list[str]:
        return sorted(o.path for o in self.run(self.store.list()))

    def read(self, path: str) -> bytes:
        return bytes(self.run(self.store.read(path)))

    def write(self, path: str, data: bytes) -> None:
        self.run(self.store.write(path, data, overwrite=True))

    def publisher(self, rival: Rival | None = None, **kw: Any) -> DeltaPublisher:
        options = dict(self.publisher_options)
        if rival is not None and self.kind == "hf":
            options["uploader"] = _rival_uploader(options["uploader"], rival)
        pub = DeltaPublisher(self.url, anchor_every=10, store_options=options, **kw)
        if rival is not None and self.kind != "hf":
            _arm_s3(pub, rival)
        return pub

    def reader(self) -> BucketReader:
        return BucketReader.open(self.url, store_options=self.reader_options)


def _rival_uploader(upload: Callable[[list[tuple[str, bytes]]], Any],
                    rival: Rival) -> Callable[[list[tuple[str, bytes]]], Any]:
    """The Hub store's upload seam, with the other writer's manifest PUT next to this one's."""

    async def racing(items: list[tuple[str, bytes]]) -> None:
        hits = [p for p, _ in items if p.endswith("/" + rival.path)]
        if not hits or rival.landed:
            await upload(items)
            return
        rival.landed = True
        rival.own = next(bytes(d) for p, d in items if p == hits[0])
        if rival.when == "before":
            await upload([(hits[0], rival.data)])
        await upload(items)
        if rival.when == "after":
            await upload([(hits[0], rival.data)])

    return racing


def _arm_s3(pub: DeltaPublisher, rival: Rival) -> None:
    """botocore's own event hooks on the publisher's S3 client: the other writer's PUT of the
    same key goes to moto right before (or right after) this publisher's PutObject of it."""
    store: Any = pub._store
    client = pub._run(store._s3())
    key = store._key(rival.path)

    async def tag(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        if params.get("Key") == key and not rival.landed:
            context["rival"] = True
            rival.own = bytes(params["Body"])

    async def land() -> None:
        rival.landed = True
        await client.put_object(Bucket=store.bucket, Key=key, Body=rival.data)

    async def before(context: dict[str, Any], **_: Any) -> None:
        if context.get("rival") and rival.when == "before" and not rival.landed:
            await land()

    async def after(context: dict[str, Any], http_response: Any, **_: Any) -> None:
        if (context.get("rival") and rival.when == "after" and not rival.landed
                and http_response.status_code == 200):
            await land()

    client.meta.events.register("provide-client-params.s3.PutObject", tag)
    client.meta.events.register("before-call.s3.PutObject", before)
    client.meta.events.register("after-call.s3.PutObject", after)


@pytest.fixture
def site_factory(request: pytest.FixtureRequest, run: Any) -> Iterator[Callable[[], Site]]:
    """``site_factory()``: a fresh bucket on the server ``request.param`` names (``s3``: moto
    with ``conditional_writes=False``, ``s3-cond``: with conditional writes)."""
    kind = request.param

    def make() -> Site:
        if kind == "hf":
            hub = request.getfixturevalue("hub")
            store = request.getfixturevalue("make_hf_store")()
            reader = {"endpoint": hub.endpoint, "token": hub.token, "environ": {}}
            return Site(kind, store, run, {**reader, "uploader": store._uploader,
                                           "part_size": 1 << 16}, reader)
        cond = kind == "s3-cond"
        store = request.getfixturevalue("make_s3_store")(conditional_writes=cond)
        reader = {"endpoint_url": store.endpoint_url, "region_name": "us-east-1",
                  "addressing_style": "path", **S3_CREDENTIALS}
        return Site(kind, store, run, {**reader, "conditional_writes": cond}, reader)

    yield make


def _copy_steps(src: Site, dst: Site, steps: list[int], *, manifests: bool = True) -> None:
    """Write ``src``'s data files of ``steps`` into ``dst``, then (``manifests``) their
    manifests over whatever ``dst`` holds under those numbers, in step order."""
    paths = src.paths()
    for path in paths:
        data = parse_data_path(path)
        if data is not None and data[0] in steps:
            dst.write(path, src.read(path))
    if manifests:
        for step in sorted(steps):
            dst.write(manifest_path(step), src.read(manifest_path(step)))


# -- what every commit was, and what a follower may hold ----------------------------------


class Ledger:
    """Every commit of the two writers by identity: the writer, its manifest, its weights."""

    def __init__(self) -> None:
        self.by_id: dict[str, tuple[str, Manifest, Weights]] = {}

    def add(self, label: str, site: Site, truth: dict[int, Weights], steps: list[int]) -> None:
        for step in steps:
            self.add_bytes(label, site.read(manifest_path(step)), truth)

    def add_bytes(self, label: str, data: bytes, truth: dict[int, Weights]) -> None:
        m = Manifest.from_json(data, source="a commit")
        assert m.writer == {"A": A, "B": B}[label]
        self.by_id[manifest_identity(data)] = (label, m, truth[m.step])

    def id_of(self, label: str, step: int) -> str:
        return next(i for i, (w, m, _) in self.by_id.items() if w == label and m.step == step)

    def check(self, f: Follower, initial: Weights) -> str | None:
        """The follower's history is one writer's chain at a time (a delta only onto the
        identity it names, which is the step applied just before), and its live tensors are
        exactly the weights of the step it reports. Returns the writer it is on."""
        prev: str | None = None
        for step, ident in f.applied:
            assert ident in self.by_id, f"applied step {step} {short_id(ident)}: no writer's commit"
            label, m, _ = self.by_id[ident]
            if m.kind == "delta":
                assert prev is not None and m.base_id == prev, (
                    f"{label}'s delta {step} applied onto {self.describe(prev)}: {f.applied}")
            prev = ident
        truth = initial if prev is None else self.by_id[prev][2]
        for k in truth:
            assert torch.equal(f.live[k], truth[k]), f"live {k} is not {self.describe(prev)}"
        reported = f.poller.status()
        assert reported.applied_id == prev
        return None if prev is None else self.by_id[prev][0]

    def describe(self, ident: str | None) -> str:
        if ident is None:
            return "nothing"
        label, m, _ = self.by_id.get(ident, ("?", None, None))
        return f"{label}'s {m.kind} {m.step}" if m is not None else short_id(ident)


def _zeros(w: Weights) -> Weights:
    return {k: torch.zeros_like(v) for k, v in w.items()}


def _writer(site: Site, seed: int, steps: range, truth: dict[int, Weights], token: str,
            run_id: str) -> None:
    """A writer publishing ``steps`` (its first one an anchor) into ``site``."""
    w, g = seeded_weights(seed), torch.Generator().manual_seed(seed + 1)
    with site.publisher(writer_token=token, run_id=run_id) as pub:
        publish_steps(pub, w, g, steps, truth)


def _settle(f: Follower, seconds: float) -> None:
    """Keep applying what the poller stages for a while (nothing may come)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        f.apply_ready()
        time.sleep(0.02)


# -- 1. a rank in the race window ---------------------------------------------------------


@pytest.mark.parametrize("site_factory", ["hf", "s3"], indirect=True)
@pytest.mark.parametrize("window", ["whole", "tail"])
def test_a_rank_in_the_race_window_never_applies_across_writers(
        site_factory: Callable[[], Site], follower_factory: Callable[..., Follower],
        window: str) -> None:
    """Writer A commits steps 0-2 and the rank applies A's 2. Writer B, racing on the same
    step numbers, then lands its own commits over them and its step 3 (a delta naming B's 2):
    over the whole chain (``whole``: B's 0-2 replace A's) or only from step 2 (``tail``).
    The rank never writes B's 3 (or any B delta) onto A's weights: it reports the branch
    change and resyncs through B's anchor (``whole``), or, when no complete chain of B's
    reaches the newest step, keeps serving A's 2 exactly, says why, and follows B's next
    anchor (``tail``). Its live tensors are always exactly the weights of the step it
    reports."""
    target, scratch = site_factory(), site_factory()
    a: dict[int, Weights] = {}
    b: dict[int, Weights] = {}
    _writer(target, 0, range(3), a, A, RUN_A)
    ledger = Ledger()
    ledger.add("A", target, a, [0, 1, 2])
    initial = _zeros(a[0])
    f = follower_factory(target.url, clone(initial), **target.follow)
    f.follow_until(lambda: f.at(2, a[2]))
    assert ledger.check(f, initial) == "A"
    on_a = len(f.applied)

    _writer(scratch, 5, range(4), b, B, RUN_B)
    ledger.add("B", scratch, b, [0, 1, 2, 3])
    _copy_steps(scratch, target, [0, 1, 2, 3] if window == "whole" else [2, 3])

    if window == "whole":
        f.follow_until(lambda: ledger.check(f, initial) == "B" and f.at(3, b[3]))
        after = f.applied[on_a:]
        assert after == [(s, ledger.id_of("B", s)) for s in range(4)], after  # B's anchor first
        status = f.poller.status()
        assert status.counters.branch_changes >= 1
        assert status.branch_lost is None
        return

    def stuck() -> bool:
        ledger.check(f, initial)
        status = f.poller.status()
        return bool(status.branch_lost) and "step 2 was computed from a step 1" in (
            status.last_error or "")

    f.follow_until(stuck)
    _settle(f, 1.0)  # 5 poll intervals, 3 branch checks: nothing of B's applies
    assert ledger.check(f, initial) == "A" and len(f.applied) == on_a and f.at(2, a[2])
    status = f.poller.status()
    assert status.applied_step == 2 and status.applied_id == ledger.id_of("A", 2)
    assert status.counters.branch_changes == 1
    lost = status.branch_lost
    assert "branch changed: the applied step 2" in lost and f"writer {B}" in lost
    assert short_id(ledger.id_of("B", 1)) in status.last_error  # the link it cannot cross

    # B, the writer left standing, goes on: a new publisher starts with an anchor (step 4)
    w, g = clone(b[3]), torch.Generator().manual_seed(11)
    with target.publisher(writer_token=B, run_id=RUN_B) as pub:
        assert pub.next_step == 4
        publish_steps(pub, w, g, range(4, 5), b)
    ledger.add("B", target, b, [4])
    f.follow_until(lambda: ledger.check(f, initial) == "B" and f.at(4, b[4]))
    assert f.applied[on_a:] == [(4, ledger.id_of("B", 4))]
    assert f.poller.status().branch_lost is None


# -- 2. interleaved commits ---------------------------------------------------------------


@pytest.mark.parametrize("site_factory", ["hf", "s3"], indirect=True)
def test_interleaved_commits_are_never_mixed(
        site_factory: Callable[[], Site], follower_factory: Callable[..., Follower],
        run: Any) -> None:
    """The two writers won alternate steps: the bucket holds 0=A, 1=B, 2=A, 3=B, each delta
    naming its own writer's base. A fresh rank applies nothing (no step of the bucket has a
    complete chain but A's anchor 0, and the newest does not reach it), says which link is
    broken, and follows the next anchor exactly; a reader's plan names the broken link."""
    target, sa, sb = site_factory(), site_factory(), site_factory()
    a: dict[int, Weights] = {}
    b: dict[int, Weights] = {}
    _writer(sa, 0, range(4), a, A, RUN_A)
    _writer(sb, 5, range(4), b, B, RUN_B)
    _copy_steps(sa, target, [0, 2])
    _copy_steps(sb, target, [1, 3])
    ledger = Ledger()
    ledger.add("A", sa, a, [0, 1, 2, 3])
    ledger.add("B", sb, b, [0, 1, 2, 3])
    a_id = {s: ledger.id_of("A", s) for s in range(4)}
    b_id = {s: ledger.id_of("B", s) for s in range(4)}

    initial = _zeros(a[0])
    f = follower_factory(target.url, clone(initial), **target.follow)
    f.follow_until(lambda: ledger.check(f, initial) is None and "step 3 was computed from a step 2"
                   in (f.poller.status().last_error or ""))
    _settle(f, 1.0)
    assert ledger.check(f, initial) is None and f.applied == []
    status = f.poller.status()
    assert status.applied_step is None and status.ready_steps == ()

    reader = target.reader()
    try:
        links = {3: (b_id[2], a_id[2]), 2: (a_id[1], b_id[1]), 1: (b_id[0], a_id[0])}
        for step, (named, held) in links.items():
            with pytest.raises(ChainError) as err:
                run(reader.plan(None, None if step == 3 else step))
            msg = str(err.value)
            assert (f"step {step} was computed from a step {step - 1} ({short_id(named)}) that "
                    f"is not the step {step - 1} in {target.url} now ({short_id(held)})") in msg
            assert "it is never applied" in msg
        assert [m.identity for m in run(reader.plan(None, 0))] == [a_id[0]]
        full = run(reader.read_full(0))
        assert all(torch.equal(full[k], a[0][k]) for k in a[0])
        problems = run(reader.verify())
        for step, (run_of, base_run) in {1: (RUN_B, RUN_A), 2: (RUN_A, RUN_B),
                                         3: (RUN_B, RUN_A)}.items():
            assert any(p.startswith(f"step {step}: run {run_of}, its base step {step - 1} is of "
                                    f"run {base_run}") for p in problems), problems
    finally:
        run(reader.close())

    # one writer goes on alone: its new publisher starts with an anchor, followed exactly
    w, g = clone(a[3]), torch.Generator().manual_seed(12)
    with target.publisher(writer_token=A, run_id=RUN_A) as pub:
        assert pub.next_step == 4
        publish_steps(pub, w, g, range(4, 5), a)
    ledger.add("A", target, a, [4])
    f.follow_until(lambda: ledger.check(f, initial) == "A" and f.at(4, a[4]))
    assert f.applied == [(4, ledger.id_of("A", 4))]


# -- 3. the publishers' side --------------------------------------------------------------


@pytest.mark.parametrize(("site_factory", "when"), [
    ("hf", "before"), ("hf", "after"), ("s3", "before"), ("s3", "after"), ("s3-cond", "before"),
], indirect=["site_factory"])
def test_the_loser_is_told_or_its_steps_are_refused(
        site_factory: Callable[[], Site], follower_factory: Callable[..., Follower],
        run: Any, when: str) -> None:
    """Writers A and B both publish step 2 after A's step 1 (B starts there: an anchor). B's
    commit lands inside A's: ``before`` A's manifest PUT (after A's existence check) or
    ``after`` it (before A reads its commit back). Then B goes on with its step 3.

    Where the store lets A see it (an S3 conditional PUT; the read-back on hf:// and on S3
    without conditional writes when B's PUT came last), A gets a PublishError naming the
    second writer, the bucket holds B's chain and a rank at A's 1 follows B's anchor exactly.
    Where it cannot (A's PUT came last and replaced B's commit unseen), the bucket holds A's
    2; readers refuse B's 3, which names B's 2 (the plan says so, a rank never applies it),
    and A is told at its next commit, which sees B's 3."""
    target, scratch = site_factory(), site_factory()
    a: dict[int, Weights] = {}
    b: dict[int, Weights] = {}
    wb, gb = seeded_weights(5), torch.Generator().manual_seed(6)
    with scratch.publisher(writer_token=B, run_id=RUN_B) as pub_b:
        publish_steps(pub_b, wb, gb, range(2, 4), b)  # B starts at step 2: an anchor, then a delta
    ledger = Ledger()
    ledger.add("B", scratch, b, [2, 3])
    _copy_steps(scratch, target, [2, 3], manifests=False)  # B's data goes up before its commits
    rival = Rival(manifest_path(2), scratch.read(manifest_path(2)), when)
    detected = when == "after" or target.kind == "s3-cond"

    wa, ga = seeded_weights(0), torch.Generator().manual_seed(1)
    pub = target.publisher(rival, writer_token=A, run_id=RUN_A)
    try:
        publish_steps(pub, wa, ga, range(2), a)
        ledger.add("A", target, a, [0, 1])
        assert not rival.landed
        initial = _zeros(a[0])
        f = follower_factory(target.url, clone(initial), **target.follow)
        f.follow_until(lambda: f.at(1, a[1]))

        train(wa, ga)
        a[2] = clone(wa)
        pub.publish(2, clone(wa).items())
        if detected:
            with pytest.raises(PublishError) as err:
                pub.flush()
            assert rival.landed and rival.own is not None
            ledger.add_bytes("A", rival.own, a)  # A's 2: in the bucket for a moment, or never
            msg = str(err.value)
            assert (f"a second writer publishes to {target.url}: step 2 was committed by writer "
                    f"{B} (run {RUN_B}); this publisher is writer {A} (run {RUN_A})") in msg
            assert target.read(manifest_path(2)) == rival.data  # B's commit stands
            _copy_steps(scratch, target, [3])  # B goes on
            train(wa, ga)
            pub.publish(3, clone(wa).items())  # A, told, is refused again, never commits
            with pytest.raises(PublishError, match=f"step 2 was committed by writer {B}"):
                pub.flush()
            assert target.read(manifest_path(3)) == scratch.read(manifest_path(3))
            f.follow_until(lambda: ledger.check(f, initial) == "B" and f.at(3, b[3]))
            ids = [i for _, i in f.applied]
            assert ids[:2] == [ledger.id_of("A", 0), ledger.id_of("A", 1)]
            assert ids[-2:] == [ledger.id_of("B", 2), ledger.id_of("B", 3)]  # B's anchor, then 3
            took_a2 = ids[2:-2]  # A's 2, if the rank took it in its moment in the bucket
            assert took_a2 in ([], [ledger.id_of("A", 2)]), f.applied
            # leaving A's 2 (gone from the bucket) is a branch change; A's 1 is still there
            assert f.poller.status().counters.branch_changes == len(took_a2)
            return

        pub.flush()  # the store cannot tell: A's PUT replaced B's commit unseen
        assert rival.landed
        ledger.add("A", target, a, [2])
        assert target.read(manifest_path(2)) == rival.own != rival.data
        assert pub.stats.last_manifest is not None
        assert pub.stats.last_manifest.identity == ledger.id_of("A", 2)
        _copy_steps(scratch, target, [3])  # B, unaware, goes on with a delta naming its 2

        reader = target.reader()
        try:
            with pytest.raises(ChainError) as chain_err:
                run(reader.plan(None))
            assert (f"step 3 was computed from a step 2 ({short_id(ledger.id_of('B', 2))}) that "
                    f"is not the step 2 in {target.url} now ({short_id(ledger.id_of('A', 2))})"
                    ) in str(chain_err.value)
            with pytest.raises(ChainError, match="was computed from a step 2"):
                run(reader.plan(run(reader.manifest(2)), 3))  # a rank holding A's 2 too
            full = run(reader.read_full(2))
            assert all(torch.equal(full[k], a[2][k]) for k in a[2])
        finally:
            run(reader.close())

        # The rank stays on A's chain (1, or 2) and says why it does not go on; or, when it
        # took B's 2 in its moment in the bucket, B's 3 applies onto exactly that. Never a mix.
        def settled() -> bool:
            if ledger.check(f, initial) == "B":
                return f.at(3, b[3])
            return "step 3 was computed from a step 2" in (f.poller.status().last_error or "")

        f.follow_until(settled)
        _settle(f, 1.0)
        if ledger.check(f, initial) == "A":
            assert f.state.applied_step in (1, 2) and settled()
        else:
            assert f.at(3, b[3])
            assert [i for _, i in f.applied][-2:] == [ledger.id_of("B", 2), ledger.id_of("B", 3)]

        train(wa, ga)
        pub.publish(3, clone(wa).items())  # A's next commit sees B's 3: told after the fact
        with pytest.raises(PublishError) as err:
            pub.flush()
        assert (f"a second writer publishes to {target.url}: step 3 was committed by writer "
                f"{B} (run {RUN_B})") in str(err.value)
        assert target.read(manifest_path(3)) == scratch.read(manifest_path(3))
    finally:
        pub.close()



# -- 4. a rank with the replaced step staged, or being written ------------------------------


@pytest.mark.parametrize("site_factory", ["hf", "s3"], indirect=True)
@pytest.mark.parametrize("moment", ["staged", "switching"])
def test_a_replaced_step_staged_or_being_written_is_not_mixed_with_the_new_chain(
        site_factory: Callable[[], Site], follower_factory: Callable[..., Follower],
        moment: str) -> None:
    """The rank holds A's 1 and has A's 2 staged (``staged``), or is writing it
    (``switching``: taken, not yet marked applied), when B's anchor 2 replaces it and B's 3
    follows. What the poller stages next is B's chain from its anchor, in step order after
    what the rank holds (never a second step 2 next to A's, nor B's 3 alone once A's 2 is
    written): the rank ends on B's 3 exactly, through B's anchor, with no refused switch."""
    target, scratch = site_factory(), site_factory()
    a: dict[int, Weights] = {}
    b: dict[int, Weights] = {}
    with scratch.publisher(writer_token=B, run_id=RUN_B) as pub_b:
        publish_steps(pub_b, seeded_weights(5), torch.Generator().manual_seed(6), range(2, 4), b)
    ledger = Ledger()
    ledger.add("B", scratch, b, [2, 3])
    wa, ga = seeded_weights(0), torch.Generator().manual_seed(1)
    with target.publisher(writer_token=A, run_id=RUN_A) as pub:
        publish_steps(pub, wa, ga, range(2), a)
        initial = _zeros(a[0])
        f = follower_factory(target.url, clone(initial), **target.follow)
        f.follow_until(lambda: f.at(1, a[1]))
        publish_steps(pub, wa, ga, range(2, 3), a)
    ledger.add("A", target, a, [0, 1, 2])
    wait_until(lambda: f.state.ready_steps() == [2], 20, "A's step 2 staged, not applied",
               status=f.poller.status)
    before = f.state.applied
    taken = f.state.take(2) if moment == "switching" else None

    _copy_steps(scratch, target, [2, 3])  # B's anchor 2 over A's, B's 3

    def in_order() -> None:
        steps = f.state.ready_steps()
        assert steps == sorted(set(steps)), f"staged steps out of order: {steps}"
        time.sleep(0.02)

    if taken is not None:
        hold = time.monotonic() + 1.5  # the switch to A's 2 takes a while; the poller plans
        while time.monotonic() < hold:
            in_order()
        f.write(before, taken)
    deadline = time.monotonic() + 20
    while 3 not in f.state.ready_steps():
        assert time.monotonic() < deadline, f.poller.status()
        in_order()
    steps, ids = f.state.ready_steps(), list(f.poller.status().ready_ids)
    assert steps == sorted(set(steps)) and steps[-1] == 3, f.poller.status()
    assert ids[-2:] == [ledger.id_of("B", 2), ledger.id_of("B", 3)]
    f.follow_until(lambda: ledger.check(f, initial) == "B" and f.at(3, b[3]))
    ids = [i for _, i in f.applied]
    assert ids[-2:] == [ledger.id_of("B", 2), ledger.id_of("B", 3)]
    assert ids[:-2] in ([ledger.id_of("A", s) for s in range(2)],
                        [ledger.id_of("A", s) for s in range(3)]), f.applied
    assert ids[:-2] == [ledger.id_of("A", s) for s in range(2 + (moment == "switching"))]
