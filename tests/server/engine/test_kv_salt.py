"""The prefix-cache salt and what a switch does to the requests, without an engine
(``server/engine/kv.py``).

The requests are stand-ins of vLLM's scheduler (``FakeScheduler`` of
tests/helpers/fake_engine.py: a state, a salt and an adapter per request, preempting running
ones); the engine tests
(tests/engine/test_kv_versions.py) show the same on vLLM's own requests and prefix cache.
A real coordinator switches through it: a switch salts, a taken-back switch restores.
"""

from __future__ import annotations

import pytest

from tests.helpers.fake_engine import FakeRank as Rank
from tests.helpers.fake_engine import FakeScheduler, make_coordinator
from vllm_deltasync.server.engine.kv import (
    IDLE,
    NEW,
    OTHER,
    RUNNING,
    SALT_PREFIX,
    KvVersions,
    cache_salt,
)


def test_the_salt_keeps_the_users_own_and_never_merges_two_versions_or_users() -> None:
    a, b = [("policy", "sha256:a")], [("policy", "sha256:b")]
    assert cache_salt(None, []) is None and cache_salt("alice", []) == "alice"
    salts = {cache_salt(user, ids) for user in (None, "alice", "bob", "") for ids in (a, b)}
    assert len(salts) == 8 and all(s is not None and s.startswith(SALT_PREFIX) for s in salts)
    assert str(cache_salt("alice", a)).endswith(":alice")
    both = [("policy", "sha256:a"), ("other", "sha256:m")]
    assert cache_salt("u", both) == cache_salt("u", list(reversed(both)))  # a set, not a list
    assert cache_salt("u", both) != cache_salt("u", a)


def _kv(*requests: tuple[str, str, str | None, str | None]) -> tuple[KvVersions, FakeScheduler]:
    sched = FakeScheduler()
    for rid, state, salt, adapter in requests:
        sched.add(rid, state, salt, adapter)
    return KvVersions(sched, ["policy"]), sched


def test_before_the_first_switch_requests_keep_their_own_salt() -> None:
    kv, sched = _kv(("a", NEW, None, None), ("b", NEW, "alice", None))
    for r in sched.unfinished():
        kv.admit(r)
    assert [r.salt for r in sched.unfinished()] == [None, "alice"] and sched.rehashed == []


@pytest.mark.parametrize("in_flight", ["keep_kv", "continue", "drain"])
def test_a_switch_resalts_what_has_not_started_and_treats_running_ones_by_in_flight(
        in_flight: str) -> None:
    kv, sched = _kv(("new", NEW, None, None), ("run", NEW, "alice", None),
                    ("idle", NEW, None, None), ("session", NEW, None, None))
    kv.switched("policy", "sha256:1", "keep_kv")  # all admitted at step 1
    old = {rid: r.salt for rid, r in sched.requests.items()}
    assert old["run"] == cache_salt("alice", [("policy", "sha256:1")])
    for rid, state in (("run", RUNNING), ("idle", IDLE), ("session", OTHER)):
        sched.requests[rid].state = state
    sched.requests["run"].computed = 70
    sched.rehashed.clear()
    sched.add("new2", NEW, "bob", None)
    out = kv.switched("policy", "sha256:2", in_flight)
    salts = {rid: r.salt for rid, r in sched.requests.items()}
    want = {rid: cache_salt(user, [("policy", "sha256:2")])
            for rid, user in (("new", None), ("new2", "bob"), ("run", "alice"), ("idle", None))}
    assert salts["new"] == want["new"] and salts["new2"] == want["new2"]
    assert salts["session"] == old["session"]  # between its inputs: left as it is
    if in_flight == "keep_kv":
        assert (out.kept, out.recomputed, out.recompute_tokens) == (3, 0, 0)
        assert sched.preempted == [] and salts["run"] == old["run"]
        assert salts["idle"] == old["idle"]  # reuses its own blocks where they still are
    else:
        assert (out.kept, out.recomputed, out.recompute_tokens) == (1, 1, 70)
        assert sched.preempted == ["run"] and salts["run"] == want["run"]
        assert salts["idle"] == want["idle"]
    assert out.resalted == len(sched.rehashed)


def test_only_the_targets_that_key_every_request_concern_the_requests() -> None:
    """An adapter's request is salted by the policy only: each followed adapter version is a
    vLLM adapter name of its own, which vLLM's block hashes cover (kv.py's module doc)."""
    kv, sched = _kv(("base", RUNNING, None, None), ("math", RUNNING, None, "math@3"))
    kv.switched("policy", "sha256:p", "continue")
    for r in sched.unfinished():  # scheduled again, on step p
        r.state = RUNNING
    sched.preempted.clear()
    salts = {r.rid: r.salt for r in sched.unfinished()}
    out = kv.switched("math", "sha256:m1", "continue")  # not a key of every request
    assert sched.preempted == [] and out.recomputed == 0 and out.resalted == 0
    assert {r.rid: r.salt for r in sched.unfinished()} == salts
    assert salts["math"] == salts["base"] == cache_salt(None, [("policy", "sha256:p")])


def test_restore_salts_requests_without_kv_as_before_the_switch() -> None:
    kv, sched = _kv(("new", NEW, None, None), ("run", RUNNING, None, None))
    kv.switched("policy", "sha256:1", "keep_kv")
    before = {rid: r.salt for rid, r in sched.requests.items()}
    kv.switched("policy", "sha256:2", "continue")  # "run" preempted: it holds no KV now
    kv.restore("policy", "sha256:1")
    assert sched.requests["new"].salt == before["new"]
    assert sched.requests["run"].salt == cache_salt(None, [("policy", "sha256:1")])
    kv.restore("policy", None)
    assert sched.requests["new"].salt is None and kv.identities == {}


def test_the_coordinators_switch_salts_and_a_take_back_restores() -> None:
    sched = FakeScheduler()
    coord, engine = make_coordinator([Rank(0), Rank(1)], requests=sched)
    sched.add("waiting", NEW, None, None)
    coord.tick()
    assert engine.version == "3" and engine.prefix_resets == 0
    salted = cache_salt(None, [("policy", "sha256:3")])
    assert sched.requests["waiting"].salt == salted
    late = sched.make("late", NEW, "alice", None)
    coord.admit(late)
    assert late.salt == cache_salt("alice", [("policy", "sha256:3")])
    record = coord.engine_status()["switches"][-1]
    assert record["in_flight"] == "keep_kv" and record["resalted"] == 1

    for r in engine.ranks:
        r.ready = [4]
    engine.fail_version = True  # the engine core's part fails after the ranks applied step 4
    coord.tick()
    assert {r.applied for r in engine.ranks} == {3} and coord.kv.identities == {"policy": "sha256:3"}
    assert sched.requests["waiting"].salt == salted, "the take-back left step 4's salt"
