"""Fault matrix, CLI and publisher inputs (item 8): a nonexistent directory is an error for
``inspect``, ``verify`` and ``import-trl`` (not "ok: 0 steps"); the CLI never prints a
traceback; ``publish(10**12)`` is refused at publish time; a killed publisher's temporary files
are removed by the next one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.faults import cli, one_line_error
from tests.helpers.publishing import Trainer
from tests.helpers.transports import S3_CREDENTIALS
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.errors import PublishError
from vllm_deltasync.stores import open_store


@pytest.mark.parametrize("verb", ["inspect", "verify", "import-trl"])
def test_nonexistent_directory_is_an_error(verb: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    argv = [verb, str(missing)] + ([str(tmp_path / "out")] if verb == "import-trl" else [])
    rc, out, err = cli(capsys, *argv)
    one_line_error(rc, err)
    assert "does not exist" in err and "ok:" not in out
    assert not (tmp_path / "out").exists()


def test_cli_never_prints_a_traceback_even_for_unexpected_errors(tmp_path: Path) -> None:
    """A file where a bucket directory should be, through the real console script."""
    (tmp_path / "f").write_text("x")
    result = subprocess.run([sys.executable, "-m", "vllm_deltasync.cli", "verify", str(tmp_path / "f")],
                            capture_output=True, text=True, timeout=120)
    one_line_error(result.returncode, result.stderr)


def test_publish_of_a_step_past_twelve_digits_is_refused_at_publish(tmp_path: Path) -> None:
    trainer = Trainer(seed=1)
    with DeltaPublisher(f"file://{tmp_path}/b", anchor_every=10) as pub:
        with pytest.raises(PublishError, match=r"10\*\*12"):
            pub.publish(10**12, trainer.weights)
        pub.publish(0, trainer.weights)  # the publisher is still usable
    assert (tmp_path / "b" / "manifests" / "000000000000.json").exists()


def test_temp_files_of_a_killed_publisher_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "b"
    orphan_dir = root / "data" / "000000000007-deadbeefdeadbeef"
    orphan_dir.mkdir(parents=True)
    stale = orphan_dir / ".tmp-00000.safetensors.abcdef123456"
    stale.write_bytes(b"half a file")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    live = root / "data" / ".tmp-live.safetensors.0123456789ab"  # another writer, still writing
    live.write_bytes(b"in progress")
    trainer = Trainer(seed=1)
    with DeltaPublisher(f"file://{root}", anchor_every=10) as pub:
        pub.publish(0, trainer.weights)
    assert not stale.exists() and not orphan_dir.exists()
    assert live.exists()


def test_unfinished_s3_uploads_of_a_killed_publisher_are_aborted(
        make_s3_store: Any, run: Any) -> None:
    """A writer killed inside a multipart upload leaves parts (billed, invisible to listing):
    the next store's first write aborts uploads older than ``stale_upload_s``, not newer ones."""
    killed = make_s3_store(prefix="p")

    async def start_upload(store: Any, path: str) -> None:
        key = store._key(path)
        upload = await store._call("write", "t", "create_multipart_upload", Key=key)
        await store._call("write", "t", "upload_part", Key=key, UploadId=upload["UploadId"],
                          PartNumber=1, Body=b"x" * 1024)

    async def uploads(store: Any) -> list[str]:
        page = await store._call("list", "t", "list_multipart_uploads", Prefix="p/")
        return sorted(u["Key"] for u in page.get("Uploads", []))

    run(start_upload(killed, "data/000000000003-aaaa/00000.safetensors"))
    assert run(uploads(killed)) == ["p/data/000000000003-aaaa/00000.safetensors"]
    # moto dates every upload 2010-11-10: younger than a 10^10 s limit, older than 0 s
    careful = open_store(killed.url, **{**_s3_settings(killed), "stale_upload_s": 1e10})
    run(careful.write("manifests/x.json", b"{}"))  # not stale: kept (it may be a live writer's)
    assert run(uploads(killed)) == ["p/data/000000000003-aaaa/00000.safetensors"]
    run(careful.close())
    sweeper = open_store(killed.url, **{**_s3_settings(killed), "stale_upload_s": 0})
    run(sweeper.write("manifests/y.json", b"{}"))
    assert run(uploads(killed)) == []
    run(sweeper.close())


def _s3_settings(store: Any) -> dict[str, Any]:
    o = store.options
    return {"endpoint_url": o.endpoint_url, "region_name": o.region_name,
            "addressing_style": o.addressing_style, **S3_CREDENTIALS}
