"""The engine core's rule for versions kept side by side (``server/engine/versions.py``): which
versions requests may use, when an older one is removed (only when no request uses it), and
that a switch waits rather than keep more than ``lora_versions_kept``; and the target rows of
adapters (``server/targets.py``). Engine-less: the engine is a stand-in that answers the
retire RPC as every rank would."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from vllm_deltasync._config_values import RESERVED_ADAPTER_NAMES
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.server.engine.versions import KeptVersions, is_ours
from vllm_deltasync.server.messages import EngineStatus, TargetReport, TargetStatus
from vllm_deltasync.server.targets import (
    DRAFTER,
    POLICY,
    adapter_id,
    adapter_target,
    switch_order,
    targets_for,
)


class Ranks:
    """Stands for the engine: ``ranks`` ranks each holding ``held`` versions, the adapter ids
    the scheduler's requests use, and the retire RPC every rank answers."""

    def __init__(self, name: str, steps: Sequence[int], ranks: int = 2) -> None:
        self.name = name
        self.held = [(s, adapter_id(name, s, None), None) for s in steps]
        self.ranks = ranks
        self.in_use: set[int] = set()
        self.retired: list[list[int]] = []

    def statuses(self) -> list[TargetStatus]:
        return [TargetStatus(rank=r, model=self.name, versions=tuple(self.held))
                for r in range(self.ranks)]

    def lora_ids_in_use(self) -> set[int]:
        return set(self.in_use)

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
                       ) -> list[Any]:
        assert method == "deltasync_retire" and (kwargs or {}).get("model") == self.name
        [ids] = args
        assert not set(ids) & self.in_use, "retired a version a request uses"
        self.retired.append(list(ids))
        self.held = [v for v in self.held if v[1] not in ids]
        return [s.to_wire() for s in self.statuses()]

    def register(self, step: int) -> None:  # what a switch does on every rank
        self.held.append((step, adapter_id(self.name, step, None), None))

    def id_of(self, step: int) -> int:
        return adapter_id(self.name, step, None)


def _kept(engine: Ranks, kept: int = 2) -> KeptVersions:
    return KeptVersions(engine, adapter_target(engine.name, kept))  # type: ignore[arg-type]


def test_a_switch_retires_the_oldest_only_when_no_request_uses_it() -> None:
    engine = Ranks("math", [4, 5])
    versions = _kept(engine)
    versions.tick(engine.statuses())
    assert [v.step for v in versions.servable()] == [4, 5] and engine.retired == []
    engine.in_use = {engine.id_of(4)}  # a request started on step 4 still runs
    assert not versions.room()  # the next switch waits
    assert not versions.admits(engine.id_of(4))  # no new request may name step 4
    assert versions.admits(engine.id_of(5))
    assert [v.step for v in versions.servable()] == [5]
    assert engine.retired == []
    versions.tick(engine.statuses())  # still in use: nothing removed
    assert engine.retired == [] and not versions.room()
    engine.in_use = set()  # it finished
    assert versions.room()
    assert engine.retired == [[engine.id_of(4)]]
    engine.register(6)
    versions.tick(engine.statuses())
    assert [v.step for v in versions.servable()] == [5, 6]


def test_versions_kept_one_drains_the_adapter_before_each_switch() -> None:
    engine = Ranks("math", [5])
    versions = _kept(engine, kept=1)
    versions.tick(engine.statuses())
    engine.in_use = {engine.id_of(5)}
    assert not versions.room() and engine.retired == []
    engine.in_use = set()
    assert versions.room() and engine.retired == [[engine.id_of(5)]]


def test_a_version_some_rank_lacks_is_not_servable() -> None:
    engine = Ranks("math", [4, 5])
    statuses = engine.statuses()
    statuses[1] = dataclasses.replace(statuses[1], versions=statuses[1].versions[:1])
    versions = _kept(engine)
    versions.tick(statuses)
    assert [v.step for v in versions.servable()] == [4]
    assert not versions.admits(engine.id_of(5))


def test_a_step_published_again_is_served_by_its_newest_registration() -> None:
    """A restarted trainer publishes step 5 again (another identity, so another id): the
    older registration is shadowed, retiring, removed once unused."""
    engine = Ranks("math", [4, 5])
    engine.held.append((5, adapter_id("math", 5, "sha256:new"), "sha256:new"))
    versions = _kept(engine, kept=3)
    engine.in_use = {engine.id_of(5)}
    versions.tick(engine.statuses())
    assert [v.adapter for v in versions.servable()] == [engine.id_of(4),
                                                         adapter_id("math", 5, "sha256:new")]
    assert engine.retired == []
    engine.in_use = set()
    versions.tick(engine.statuses())
    assert engine.retired == [[engine.id_of(5)]]


def test_the_report_is_what_the_api_resolves_with() -> None:
    engine = Ranks("math", [4, 5])
    versions = _kept(engine)
    versions.tick(engine.statuses())
    report = versions.report(engine.statuses())
    assert report["versions"] == [[4, engine.id_of(4), None], [5, engine.id_of(5), None]]
    assert report["refused"] is None and is_ours(engine.id_of(4)) and not is_ours(7)


def test_adapter_rows_come_from_the_config() -> None:
    config = SyncConfig(url="file:///b", lora_urls={"math": "file:///m", "code": "file:///c"},
                        lora_versions_kept=3)
    rows = targets_for(config)
    assert [r.name for r in rows] == ["policy", "drafter", "math", "code"]
    math = rows[2]
    assert math.writer == "adapter" and math.surface_scope == "lora"
    policy = math.policy
    assert policy.versions_kept == 3 and not policy.holds_engine
    assert not (policy.resets_prefix_cache or policy.labels_version or policy.drains
                or policy.trainer_driven)
    source = math.source(config)
    assert source is not None and source.config.url == "file:///m"
    assert source.config.lora_urls == {} and source.config.loaded_step is None
    assert math.source(SyncConfig(url="file:///b")) is None
    assert targets_for(SyncConfig(url="file:///b")) == (POLICY, DRAFTER)
    assert [r.name for r in switch_order(rows)] == ["math", "code", "drafter", "policy"]
    assert POLICY.writer == DRAFTER.writer == "params" and POLICY.policy.versions_kept is None


@pytest.mark.parametrize("name", ["policy", "drafter", "rank", "versions", "switches", "synced"])
def test_adapter_names_that_clash_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="is reserved"):
        SyncConfig(url="file:///b", lora_urls={name: "file:///x"})


def test_the_reserved_names_cover_every_key_beside_an_adapter_status() -> None:
    """An adapter's status is the value of its name in a rank's status dict, its report in
    the engine status, its rows in /synced: none of those keys may be an adapter's name."""
    rank_keys = set(TargetStatus(rank=0, model="policy").to_wire())
    engine_keys = set(EngineStatus(active=True, weight_version=None, last_error=None,
                                   failed_ticks=0, failing=False, reloads=0, metrics_port=None,
                                   targets={"policy": TargetReport()},
                                   primary="policy").to_wire())
    synced_keys = {"synced", "max_steps_behind", "ranks", "coordinator"}
    missing = (rank_keys | engine_keys | synced_keys) - RESERVED_ADAPTER_NAMES
    assert not missing, f"add to RESERVED_ADAPTER_NAMES: {sorted(missing)}"


def test_a_version_is_servable_as_soon_as_its_switch_stands() -> None:
    """Requests the engine core adds right after a switch (before its next tick reads the
    ranks) may name the new version."""
    engine = Ranks("math", [4])
    versions = _kept(engine)
    versions.tick(engine.statuses())
    assert versions.room()
    engine.register(5)
    versions.switched(5, None)
    assert versions.admits(engine.id_of(5)) and [v.step for v in versions.servable()] == [4, 5]
