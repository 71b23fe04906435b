"""Red-team findings on the CLI and the publisher (issue 23): one garbage newest manifest does
not freeze publishers, readers or the CLI (item 3); ``materialize`` refuses an anchor whose files
cannot hold what it claims before allocating it (item 4). Each is one clear line, no traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.publishing import Trainer, bits_equal, manifest_steps, publish_run
from vllm_deltasync import BucketReader, DeltaPublisher
from vllm_deltasync.cli import main
from vllm_deltasync.format._listing import newest_readable
from vllm_deltasync.format.manifest import fingerprint, load_document

GARBAGE = "manifests/999999999999.json"


def _plant(root: Path, what: str) -> Path:
    """``manifests/999999999999.json``: not JSON, or the manifest of step 1 under that name."""
    path = root / GARBAGE
    if what == "not-json":
        path.write_bytes(b"\x00garbage, not a manifest")
    else:
        shutil.copy(root / "manifests" / f"{1:012d}.json", path)
    return path


@pytest.fixture(params=["not-json", "other-step"])
def garbage(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _skips(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and GARBAGE in r.getMessage()]


# ---------------------------------------------------------------------------- item 3
def test_a_publisher_starting_on_a_garbage_newest_manifest_publishes_after_the_newest_readable(
        tmp_path: Path, garbage: str, caplog: pytest.LogCaptureFixture) -> None:
    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    trainer = Trainer(seed=1)
    publish_run(url, range(3), trainer, anchor_every=10)
    _plant(root, garbage)
    caplog.set_level(logging.WARNING)
    with DeltaPublisher(url, anchor_every=10) as pub:  # a restart: another writer token
        assert pub.last_step == 2
        for step in (3, 4, 5):
            trainer.step()
            pub.publish(step, trainer.weights)
        pub.flush()
    lines = _skips(caplog)
    # once at start, once by the second-writer check (then remembered): one line each
    assert len(lines) == 2 and all("\n" not in line and "skipped" in line for line in lines)
    assert manifest_steps(root) == [0, 1, 2, 3, 4, 5, 999999999999]
    assert bits_equal(_read_full(url, 5), trainer.bf16())


def test_a_live_publisher_skips_a_garbage_manifest_planted_after_its_start(
        tmp_path: Path, garbage: str, caplog: pytest.LogCaptureFixture) -> None:
    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    trainer = Trainer(seed=2)
    caplog.set_level(logging.WARNING)
    with DeltaPublisher(url, anchor_every=10) as pub:
        for step in range(6):
            trainer.step()
            pub.publish(step, trainer.weights)
            if step == 2:
                pub.flush()
                _plant(root, garbage)
        pub.flush()
    assert len(_skips(caplog)) == 1  # reported once, not at every commit
    assert manifest_steps(root)[:-1] == list(range(6))
    assert bits_equal(_read_full(url, 5), trainer.bf16())


def test_newest_readable_walks_back_with_one_warning_per_skipped_manifest(
        tmp_path: Path, garbage: str) -> None:
    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    publish_run(url, range(3), Trainer(seed=3), anchor_every=10)
    _plant(root, garbage)
    (root / "manifests" / f"{999999999998:012d}.json").write_bytes(b"{}")
    lines: list[str] = []

    async def go() -> Any:
        async with BucketReader.open(url) as reader:
            return await newest_readable(reader, warn=lines.append)

    step, manifest = asyncio.run(go())
    assert step == 2 and manifest.step == 2
    assert len(lines) == 2 and GARBAGE in lines[0] and "999999999998.json" in lines[1]
    assert all("\n" not in line for line in lines)


def test_a_reader_and_a_following_server_skip_a_garbage_newest_manifest(
        tmp_path: Path, garbage: str, caplog: pytest.LogCaptureFixture) -> None:
    """The reader's newest step is the newest that reads, and a server that starts on a bucket
    holding the garbage follows the newest readable step and every step published after it."""
    from vllm_deltasync.config import SyncConfig
    from vllm_deltasync.server.worker.poller import Poller

    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    trainer = Trainer(seed=4)
    caplog.set_level(logging.WARNING)
    with DeltaPublisher(url, anchor_every=10) as pub:
        for step in range(3):
            trainer.step()
            pub.publish(step, trainer.weights)
        pub.flush()
        _plant(root, garbage)
        poller = Poller(SyncConfig(url=url, poll_interval_s=0.05),
                        lambda m, patches: (patches, 0), applied_step=None)
        poller.start()
        try:
            _wait(lambda: 2 in poller.state.ready_steps())
            server_lines = [m for m in _skips(caplog) if m.startswith("deltasync rank=0")]
            assert len(server_lines) == 1  # one line naming it, then set aside
            for step in (3, 4):
                trainer.step()
                pub.publish(step, trainer.weights)
            pub.flush()
            _wait(lambda: 4 in poller.state.ready_steps())
            status = poller.status()
            assert status.newest_step == 4 and status.last_error is None, status
            assert [m for m in _skips(caplog) if m.startswith("deltasync rank=0")] == server_lines
        finally:
            poller.close()

    async def latest() -> int | None:
        async with BucketReader.open(url) as reader:
            return await reader.latest_step()

    assert asyncio.run(latest()) == 4


def test_a_server_reports_a_newer_format_instead_of_skipping_it(tmp_path: Path) -> None:
    """Unlike garbage, a manifest of a format this release does not read is the trainer being
    newer than the server: the server must say so (not synced, last_error naming the release
    it needs), not quietly stay on the newest step it can read."""
    from vllm_deltasync.config import SyncConfig
    from vllm_deltasync.errors import UnsupportedFormatError
    from vllm_deltasync.format.manifest import dump_document
    from vllm_deltasync.server.worker.poller import Poller

    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    publish_run(url, range(2), Trainer(seed=5), anchor_every=10)
    doc = load_document((root / "manifests" / f"{1:012d}.json").read_bytes())
    doc.update(step=2, schema_version=99, requires="vllm-deltasync>=9.0")
    (root / "manifests" / f"{2:012d}.json").write_bytes(dump_document(doc))
    with pytest.raises(UnsupportedFormatError, match="vllm-deltasync>=9.0"):
        asyncio.run(_manifest(url, 2))
    poller = Poller(SyncConfig(url=url, poll_interval_s=0.05),
                    lambda m, patches: (patches, 0), applied_step=None)
    poller.start()
    try:
        _wait(lambda: "vllm-deltasync>=9.0" in (poller.status().last_error or ""))
        assert poller.status().newest_step != 1  # not taken as "the newest step is 1"
    finally:
        poller.close()


async def _manifest(url: str, step: int) -> Any:
    async with BucketReader.open(url) as reader:
        return await reader.manifest(step)


def _wait(done: Any, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_cli_survives_a_garbage_newest_manifest(tmp_path: Path, garbage: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root, url = tmp_path / "b", f"file://{tmp_path}/b"
    truth = publish_run(url, range(3), Trainer(seed=4), anchor_every=10)
    _plant(root, garbage)
    out = tmp_path / "out"
    assert main(["materialize", url, "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "wrote" in cap.out and "step 2" in cap.out
    warnings = [line for line in cap.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and GARBAGE in warnings[0], cap.err
    from safetensors.torch import load_file
    assert bits_equal(load_file(str(out / "model.safetensors")), truth[2])

    assert main(["inspect", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["steps"]] == [0, 1, 2]
    assert len(doc["problems"]) == 1 and "999999999999.json" in doc["problems"][0]

    assert main(["verify", url]) == 1  # the garbage is a problem, reported on one line
    cap = capsys.readouterr()
    assert cap.out.count("999999999999.json") == 1 and "Traceback" not in cap.out + cap.err
    assert "1 problem(s)" in cap.err


# ---------------------------------------------------------------------------- item 4
def _hostile_anchor(root: Path, version: int) -> None:
    """A valid-looking anchor claiming a 2^39-element tensor (1 TiB bf16) in an 8 KiB file.

    v2: the chunk and the file's recorded size claim it (the file is 8 KiB). v1: the file's
    recorded size is honest, its one dense chunk claims the 2^39 elements (positions only)."""
    with DeltaPublisher(f"file://{root}", format_version=version) as pub:
        pub.publish(0, {"w": torch.randn(64, 64)})
    path = root / "manifests" / f"{0:012d}.json"
    doc = load_document(path.read_bytes())
    n = 1 << 39
    doc["tensors"][0].update(shape=[1 << 20, 1 << 19], changed=n)
    chunk = doc["tensors"][0]["chunks"][0]
    doc["totals"].update(elements=n, changed=n)
    doc["fingerprint"] = fingerprint([("w", (1 << 20, 1 << 19), "bfloat16")])
    if version == 1:
        chunk.update(stop=n)
    else:
        chunk.update(count=n, region=[0, n])
        chunk["roles"]["values"]["length"] = 2 * n
        entry = doc["files"][0]
        offset = entry["index"]["w"][0][0]
        entry.update(size=offset + 2 * n, index={"w": [[offset, 2 * n]]})
        doc["totals"].update(bytes=entry["size"])
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(("version", "refusal"), [
    (1, "step 0 of file://{root}: anchor claims 549755813888 bf16 elements (1024.0 GiB) but its "
        "1 data files hold 8.2 KiB; the manifest is corrupt or hostile, nothing was allocated"),
    (2, "is 8352 bytes, its manifest says 1099511627936; the file or manifest is corrupt"),
])
def test_materialize_refuses_an_anchor_claiming_more_than_its_files_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        version: int, refusal: str) -> None:
    root = tmp_path / "b"
    _hostile_anchor(root, version)
    real_empty = torch.empty

    def guarded(*size: Any, **kw: Any) -> torch.Tensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        numel = 1
        for d in dims:
            numel *= int(d)
        assert numel < 1 << 24, f"torch.empty of {numel} elements"
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", guarded)
    assert main(["materialize", f"file://{root}", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "torch.empty" not in err
    assert err.startswith("vllm-deltasync materialize: step 0")
    assert refusal.format(root=root) in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_materialize_refuses_an_anchor_whose_file_is_missing_or_short(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/b"
    publish_run(url, range(2), Trainer(seed=5), anchor_every=10)
    data = sorted((tmp_path / "b" / "data").glob(f"{0:012d}-*/00000.safetensors"))[0]
    data.write_bytes(data.read_bytes()[:100])
    assert main(["materialize", url, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is 100 bytes, its manifest says" in err
    data.unlink()
    assert main(["materialize", url, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is missing" in err


def _read_full(url: str, step: int) -> dict[str, torch.Tensor]:
    async def go() -> dict[str, torch.Tensor]:
        async with BucketReader.open(url) as reader:
            return await reader.read_full(step)

    return asyncio.run(go())
