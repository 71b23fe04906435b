"""`vllm-deltasync inspect`, verb registration, and the package's public surface."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import vllm_deltasync
from tests.helpers.publishing import Trainer, publish_run
from vllm_deltasync import cli


def test_inspect_reports_steps_kinds_bytes_sparsity_and_chains(
    bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    publish_run(bucket, range(7), Trainer(), anchor_every=3, keep_anchors=5)
    (Path(bucket[7:]) / "manifests" / f"{4:012d}.json").unlink()  # break the second chain
    assert cli.main(["inspect", bucket, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["steps"]] == [0, 1, 2, 3, 5, 6]
    assert [r["kind"] for r in doc["steps"]] == ["anchor", "delta", "delta", "anchor", "delta", "anchor"]
    for row in doc["steps"]:
        files = sorted((Path(bucket[7:]) / "data").glob(f"{row['step']:012d}-*/*.safetensors"))
        assert row["bytes"] == sum(f.stat().st_size for f in files) > 0
        assert row["sparsity"] == pytest.approx(1 - row["changed"] / row["elements"])
    assert all(0.9 < r["sparsity"] < 1 for r in doc["steps"][1:3])
    assert [(c["anchor"], c["steps"], c["complete"]) for c in doc["chains"]] == [
        (0, 3, True), (3, 2, False), (6, 1, True)]
    assert cli.main(["inspect", bucket]) == 0
    text = capsys.readouterr().out
    assert "6 steps, 3 anchors" in text and "chain from anchor 3: steps 3..5 (2), BROKEN" in text


def test_errors_are_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "ftp://nowhere/x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-deltasync inspect: bucket URL 'ftp://nowhere/x': unknown scheme")
    assert "\n" not in err
    assert cli.main([]) == 2


def test_every_verb_of_the_table_builds_and_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    for verb in cli.VERBS:
        with pytest.raises(SystemExit) as exc:
            cli.main([verb, "--help"])
        assert exc.value.code == 0, verb
        assert "unavailable" not in capsys.readouterr().out, verb


def test_public_api_is_pinned() -> None:
    assert vllm_deltasync.__all__ == [
        "AlreadyExistsError", "ApplyError", "AuthError", "BucketReader", "ChainError",
        "ConfigError", "DeltaPublisher", "DeltaSyncError", "DeltaSyncExtension",
        "FingerprintError", "FormatError", "IntegrityError", "Manifest", "NotFoundError",
        "PublishError", "PublisherOptions", "RateLimitedError", "StoreError", "TransientStoreError",
        "UnsupportedFormatError", "__version__", "open_store",
    ]
    for name in vllm_deltasync.__all__:
        if name != "DeltaSyncExtension":  # resolved lazily; needs the extension module
            assert getattr(vllm_deltasync, name) is not None
    with pytest.raises(AttributeError):
        vllm_deltasync.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
