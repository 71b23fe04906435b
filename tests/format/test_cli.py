"""`vllm-deltasync inspect`, verb registration, and the package's public surface."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import vllm_deltasync
from vllm_deltasync import cli

from .conftest import REPO, Trainer, publish_run


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


def test_verbs_plug_in_without_editing_cli(capsys: pytest.CaptureFixture[str]) -> None:
    module = type(sys)("_deltasync_test_verb")

    def add_parser(subparsers: Any) -> None:
        p = subparsers.add_parser("hello")
        p.add_argument("name")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)

    module.add_parser = add_parser  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    cli.register_command("hello", module.__name__)
    try:
        parser = cli.build_parser()
        assert isinstance(parser, argparse.ArgumentParser)
        assert cli.main(["hello", "world"]) == 3
        assert capsys.readouterr().out == "hello world\n"
    finally:
        del cli._COMMANDS["hello"]
        del sys.modules[module.__name__]


def test_public_api_is_pinned() -> None:
    assert vllm_deltasync.__all__ == [
        "AlreadyExistsError", "ApplyError", "AuthError", "BucketReader", "ChainError",
        "ConfigError", "DeltaPublisher", "DeltaSyncError", "DeltaSyncExtension",
        "FingerprintError", "FormatError", "IntegrityError", "Manifest", "NotFoundError",
        "PublishError", "RateLimitedError", "StoreError", "TransientStoreError", "__version__",
        "open_store",
    ]
    for name in vllm_deltasync.__all__:
        if name != "DeltaSyncExtension":  # resolved lazily; needs the extension module
            assert getattr(vllm_deltasync, name) is not None
    with pytest.raises(AttributeError):
        vllm_deltasync.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_import_never_imports_vllm() -> None:
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None  # any `import vllm` now raises ImportError\n"
        "import vllm_deltasync, vllm_deltasync.cli\n"
        "from vllm_deltasync import DeltaPublisher, BucketReader\n"
        "assert not [m for m in sys.modules if m.startswith('vllm.')]\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
