"""One chain, one identity (issue 23): a rank applies a delta only onto the exact weights it was
computed from, whatever the step numbers say.

Every case runs the real poller (the rank's ``Poller`` and ``SyncState``) against a real bucket
written by the real ``DeltaPublisher``; the applier below takes the staged steps, checks them
with the rank's own chain check (``switching.check_chain``, what ``RankSwitch.apply`` runs before it
writes anything) and writes them into a dict of live tensors. The evidence is the weights: the
live tensors must equal the trainer's at the step the poller reports, and a step of another
branch must never be written onto them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.follow import (
    Follower,
    Weights,
    clone,
    publish_steps,
    remove_steps,
    seeded_weights,
    train,
)
from tests.helpers.waiting import wait_until
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import ChainError
from vllm_deltasync.format.layout import manifest_path
from vllm_deltasync.format.manifest import dump_document, load_document, manifest_identity
from vllm_deltasync.server.worker.state import StagedStep
from vllm_deltasync.server.worker.switching import check_chain


def _run_a(url: str, truth: dict[int, Weights], format_version: int = 3) -> dict[int, Weights]:
    """Run A: steps 0-3; returns the trainer's checkpoints by step."""
    w, g = seeded_weights(0), torch.Generator().manual_seed(1)
    with DeltaPublisher(url, anchor_every=10, format_version=format_version) as pub:
        publish_steps(pub, w, g, range(4), truth)
    return truth


@pytest.mark.parametrize("format_version", [3, 1])
def test_restart_with_steps_removed_and_republished_never_applies_across(
        tmp_path: Path, follower_factory: Callable[..., Follower], format_version: int) -> None:
    """The red team's case: the server is at run A's step 3; the trainer restarts from step 1's
    checkpoint, the operator removes steps 2-3 and the new run publishes 2 (anchor), 3, 4. The
    server must not apply the new 4 on the old 3: it reports the branch change and ends on the
    new run's step 4, bit for bit (format 1 buckets: by re-reading the base manifest)."""
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    a = _run_a(url, {}, format_version)
    f = follower_factory(url, {k: torch.zeros_like(v) for k, v in a[0].items()})
    f.follow_until(lambda: f.at(3, a[3]))
    old_three = f.state.applied_manifest().identity

    remove_steps(root, [2, 3])
    b, w, g = {}, clone(a[1]), torch.Generator().manual_seed(7)
    with DeltaPublisher(url, anchor_every=10, resumed_from=1,
                        format_version=format_version) as pub:
        assert pub.next_step == 2
        publish_steps(pub, w, g, range(2, 5), b)
    f.follow_until(lambda: f.at(4, b[4]))
    steps = [s for s, _ in f.applied]
    assert steps[-3:] == [2, 3, 4], f.applied  # through the new run's anchor
    assert old_three not in [i for s, i in f.applied if s > 3]
    status = f.poller.status()
    assert status.counters.branch_changes >= 1
    assert status.branch_lost is None and status.applied_id == f.applied[-1][1]


def test_documented_restart_publishes_an_anchor_at_the_next_free_step(
        tmp_path: Path, follower_factory: Callable[..., Follower]) -> None:
    """The README's flow: nothing is removed; the restarted trainer opens a new publisher,
    which starts with an anchor at ``next_step`` and records the checkpoint it resumed from.
    The server follows through that anchor and counts one branch change (it had applied
    steps 2-3 of the abandoned run); nothing was lost, so it is never unsynced for it."""
    url = f"file://{tmp_path}/bucket"
    a = _run_a(url, {})
    f = follower_factory(url, {k: torch.zeros_like(v) for k, v in a[0].items()})
    f.follow_until(lambda: f.at(3, a[3]))
    b, w, g = {}, clone(a[1]), torch.Generator().manual_seed(9)
    with DeltaPublisher(url, anchor_every=10, resumed_from=1) as pub:
        assert pub.next_step == 4
        with pytest.raises(Exception, match="steps must increase"):
            pub.publish(3, w.items())  # a committed step number is never reused
        publish_steps(pub, w, g, range(pub.next_step, 7), b)
        first = pub.stats.last_manifest
    f.follow_until(lambda: f.at(6, b[6]))
    reader_doc = load_document((tmp_path / "bucket" / manifest_path(4)).read_bytes())
    assert reader_doc["kind"] == "anchor" and reader_doc["resumed_from"] == 1
    assert first is not None and first.step == 6 and first.base_id is not None
    status = f.poller.status()
    assert status.counters.branch_changes == 1 and status.branch_lost is None


def test_wiped_bucket_and_new_run_from_zero_is_followed(
        tmp_path: Path, follower_factory: Callable[..., Follower]) -> None:
    """The bucket is wiped and a new run starts at step 0, below the applied step 3: the server
    reports the branch change (and is not synced meanwhile) and follows the new run."""
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    a = _run_a(url, {})
    f = follower_factory(url, {k: torch.zeros_like(v) for k, v in a[0].items()})
    f.follow_until(lambda: f.at(3, a[3]))
    shutil.rmtree(root)
    b, w, g = {}, seeded_weights(5), torch.Generator().manual_seed(6)
    with DeltaPublisher(url, anchor_every=10) as pub:
        publish_steps(pub, w, g, range(2), b)
    seen_lost: list[str] = []

    def done() -> bool:
        lost = f.poller.status().branch_lost
        if lost:
            seen_lost.append(lost)
        return f.at(1, b[1])

    f.follow_until(done)
    assert seen_lost and "branch changed" in seen_lost[0] and "no readable step 3" in seen_lost[0]
    assert f.poller.status().counters.branch_changes == 1


def test_steps_rewritten_in_place_with_nothing_newer_are_seen(
        tmp_path: Path, follower_factory: Callable[..., Follower]) -> None:
    """Steps 2-3 are replaced by another run's 2 (anchor) and 3, and nothing newer comes: the
    periodic re-read of the applied step's manifest finds it rewritten and the server resyncs."""
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    a = _run_a(url, {})
    f = follower_factory(url, {k: torch.zeros_like(v) for k, v in a[0].items()})
    f.follow_until(lambda: f.at(3, a[3]))
    remove_steps(root, [2, 3])
    b, w, g = {}, clone(a[1]), torch.Generator().manual_seed(3)
    with DeltaPublisher(url, anchor_every=10) as pub:
        publish_steps(pub, w, g, range(2, 4), b)
    f.follow_until(lambda: f.at(3, b[3]))
    assert f.applied[-1][1] != f.applied[-3][1]  # the same number, another identity
    assert f.poller.status().counters.branch_changes == 1


def test_loaded_step_takes_the_bucket_identity_and_refuses_another_run(
        tmp_path: Path, follower_factory: Callable[..., Follower]) -> None:
    """``loaded_step`` names the bucket step the loaded weights are: the rank adopts that
    manifest's identity, so a delta of another run (same base number and identity, other
    run id) is refused like the reader refuses it, and nothing is staged."""
    url, root = f"file://{tmp_path}/bucket", tmp_path / "bucket"
    truth: dict[int, Weights] = {}
    w, g = seeded_weights(0), torch.Generator().manual_seed(1)
    with DeltaPublisher(url, anchor_every=10) as pub:
        publish_steps(pub, w, g, range(2), truth)
    f = follower_factory(url, clone(truth[1]), loaded_step=1)
    f.follow_until(lambda: f.state.applied_manifest() is not None)
    assert f.state.applied_manifest().identity == manifest_identity(
        (root / manifest_path(1)).read_bytes())
    # a delta 2 computed elsewhere from the same weights, made to name this bucket's step 1 as
    # its base (number and identity), under another run id
    a2 = clone(truth[1])
    train(a2, g)
    src = tmp_path / "other"
    with DeltaPublisher(f"file://{src}", anchor_every=10) as pub3:
        pub3.publish(0, truth[0].items())
        pub3.publish(1, truth[1].items())
        pub3.publish(2, a2.items())
    for folder in (src / "data").glob(f"{2:012d}-*"):
        shutil.copytree(folder, root / "data" / folder.name)
    doc = load_document((src / manifest_path(2)).read_bytes())
    doc["base_id"] = manifest_identity((root / manifest_path(1)).read_bytes())
    doc["run_id"] = "feedfacefeedface"
    (root / manifest_path(2)).write_bytes(dump_document(doc))
    wait_until(lambda: "never crosses runs" in (f.poller.status().last_error or ""), 10,
               "the poller refusing step 2 of another run", status=f.poller.status)
    f.apply_ready()
    status = f.poller.status()
    assert status.applied_step == 1 and status.ready_steps == ()
    assert all(torch.equal(f.live[k], truth[1][k]) for k in truth[1])


def test_the_rank_check_refuses_a_delta_planned_on_other_weights(tmp_path: Path) -> None:
    """``RankSwitch.apply``'s check before writing: the base identity a delta was planned onto
    must be the applied one, and the last step must be the one the engine core chose."""
    url = f"file://{tmp_path}/bucket"
    truth: dict[int, Weights] = {}
    w, g = seeded_weights(0), torch.Generator().manual_seed(1)
    with DeltaPublisher(url, anchor_every=10) as pub:
        publish_steps(pub, w, g, range(3), truth)
    from vllm_deltasync.format.reader import BucketReader

    reader = BucketReader.open(url)
    from vllm_deltasync._loop import default_loop

    m0, m1, m2 = (default_loop().run(reader.manifest(s), 10) for s in range(3))
    default_loop().run(reader.close(), 10)
    ok = StagedStep(m2, [], 0, 0, 0.0, base_identity=m1.identity)
    check_chain(0, (1, m1), [ok], m2.identity)
    with pytest.raises(ChainError, match="exact weights it was computed from"):
        check_chain(0, (1, m0), [ok], None)  # the engine holds another manifest
    with pytest.raises(ChainError, match="unknown weights"):
        check_chain(0, (1, None), [ok], None)  # a number without an identity is not enough
    with pytest.raises(ChainError, match="the engine core chose"):
        check_chain(0, (1, m1), [ok], m1.identity)
