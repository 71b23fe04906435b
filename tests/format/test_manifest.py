"""The manifest document: names, JSON round trip, validation, fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.layout import (
    data_path,
    manifest_path,
    parse_data_path,
    parse_manifest_path,
)
from vllm_deltasync.format.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    TensorEntry,
    Totals,
    fingerprint,
)

SHA = "ab" * 32


def make(step: int = 42, kind: str = "delta") -> Manifest:
    files = (FileEntry(data_path(step, "9f3a", 0), 100, SHA),)
    chunk = Chunk(0, {"indices": "w.indices", "values": "w.values"}, 0, 3)
    tensor = TensorEntry("w", (4, 5), "bfloat16", "sparse-v1", 3, (chunk,))
    base, anchor = (None, step) if kind == "anchor" else (step - 1, step - 2)
    return Manifest(step, kind, base, anchor, 1.5, fingerprint([("w", (4, 5), "bfloat16")]),  # type: ignore[arg-type]
                    files, (tensor,), Totals(1, 20, 3, 100), schema_version=1)


def test_paths_are_zero_padded_and_parse_back() -> None:
    assert manifest_path(42) == "manifests/000000000042.json"
    assert parse_manifest_path(manifest_path(7)) == 7
    assert parse_manifest_path("manifests/42.json") is None
    assert parse_manifest_path("data/000000000042-ab/00000.safetensors") is None
    path = data_path(42, "9f3a", 3)
    assert path == "data/000000000042-9f3a/00003.safetensors"
    assert parse_data_path(path) == (42, "9f3a")
    assert sorted(manifest_path(s) for s in (10, 9, 100)) == [manifest_path(s) for s in (9, 10, 100)]
    with pytest.raises(FormatError):
        manifest_path(-1)


def test_json_round_trip() -> None:
    m = make()
    again = Manifest.from_json(m.to_json(), source="x.json")
    assert again == m
    assert again.sparsity == pytest.approx(1 - 3 / 20)
    assert again.tensor("w") is not None and again.tensor("nope") is None


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("schema_version", 4, "schema_version 4"),
        ("format", "other", "format is 'other'"),
        ("kind", "full", "kind 'full'"),
        ("base_step", 50, "base_step"),
        ("fingerprint", "md5:00", "fingerprint"),
        ("step", -3, "'step'"),
    ],
)
def test_invalid_fields_name_the_file(field: str, value: object, needle: str) -> None:
    doc = json.loads(make().to_json())
    doc[field] = value
    with pytest.raises(FormatError) as err:
        Manifest.from_json(json.dumps(doc).encode(), source="bucket/manifests/000000000042.json")
    assert "bucket/manifests/000000000042.json" in str(err.value)
    assert needle in str(err.value)


def test_structural_defects_are_format_errors() -> None:
    doc = json.loads(make().to_json())
    for mutate in (
        lambda d: d["tensors"][0]["chunks"][0].update(file=3),
        lambda d: d["files"][0].update(sha256="xyz"),
        lambda d: d["files"][0].update(path="../etc/passwd"),
        lambda d: d["totals"].update(bytes=5),
        lambda d: d["tensors"].append(dict(d["tensors"][0])),
        lambda d: d["tensors"][0].update(dtype="float16"),
        lambda d: d.pop("files"),
    ):
        broken = json.loads(json.dumps(doc))
        mutate(broken)
        with pytest.raises(FormatError, match="m.json"):
            Manifest.from_json(json.dumps(broken).encode(), source="m.json")
    with pytest.raises(FormatError, match="not valid JSON"):
        Manifest.from_json(b"{oops", source="m.json")


def test_anchor_rules() -> None:
    anchor = make(10, "anchor")
    assert Manifest.from_json(anchor.to_json(), source="a").kind == "anchor"
    doc = json.loads(anchor.to_json())
    doc["base_step"] = 9
    with pytest.raises(FormatError, match="anchor"):
        Manifest.from_json(json.dumps(doc).encode(), source="a")


def test_fingerprint_depends_on_names_shapes_dtypes_not_order() -> None:
    a = [("x", (2, 3), "bfloat16"), ("y", (4,), "bfloat16")]
    assert fingerprint(a) == fingerprint(reversed(a))
    assert fingerprint(a).startswith("sha256:") and len(fingerprint(a)) == 7 + 64
    assert fingerprint(a) != fingerprint([("x", (3, 2), "bfloat16"), ("y", (4,), "bfloat16")])
    assert fingerprint(a) != fingerprint([("x", (2, 3), "bfloat16"), ("z", (4,), "bfloat16")])
    assert fingerprint(a) != fingerprint([("x", (2, 3), "float16"), ("y", (4,), "bfloat16")])


def test_fingerprint_matches_the_documented_example() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    value = fingerprint([("b", (3,), "bfloat16"), ("a", (2, 2), "bfloat16")])
    assert value == "sha256:e7c3abe30d07e833b4dafc23a969a69ef661d5c12708e058e3437a5b3c37d54e"
    assert value in doc
