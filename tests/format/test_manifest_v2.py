"""Manifest format v2: schema, round trip, and one-line refusals of what this reader cannot read."""

from __future__ import annotations

import json

import pytest

from vllm_deltasync.errors import FormatError
from vllm_deltasync.format.layout import data_path
from vllm_deltasync.format.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    Region,
    RoleRange,
    TensorEntry,
    Totals,
    fingerprint,
)

SHA = "cd" * 32


def make_v2() -> Manifest:
    roles = {"values": RoleRange("w", "BF16", 80, 40)}
    chunk = Chunk(0, {"values": "w"}, 0, 20, {}, Region(0, 1, 20, 20), roles, SHA)
    tensor = TensorEntry("w", (4, 5), "bfloat16", "dense", 20, (chunk,))
    files = (FileEntry(data_path(7, "ab12cd34ef567890", 0), 120, "ab" * 32, {"w": ((80, 40),)}),)
    return Manifest(7, "anchor", None, 7, 1.5, fingerprint([("w", (4, 5), "bfloat16")]), files,
                    (tensor,), Totals(1, 20, 20, 120), run_id="0123456789abcdef",
                    writer="fedcba9876543210", schema_version=2)


def test_v2_round_trip_names_its_versions() -> None:
    m = make_v2()
    doc = json.loads(m.to_json())
    assert doc["schema_version"] == 2 and doc["requires"] == "vllm-deltasync>=0.2.0"
    assert doc["tensors"][0]["codec_version"] == 1
    assert doc["run_id"] == "0123456789abcdef" and doc["writer"] == "fedcba9876543210"
    again = Manifest.from_json(m.to_json(), source="x.json")
    assert again.to_dict() == doc
    assert again.tensors[0].chunks[0].region == Region(0, 1, 20, 20)


def test_newer_format_is_refused_in_one_line_naming_the_reader_it_needs() -> None:
    doc = json.loads(make_v2().to_json())
    doc["schema_version"], doc["requires"] = 4, "vllm-deltasync>=0.7.0"
    with pytest.raises(FormatError) as err:
        Manifest.from_json(json.dumps(doc).encode(), source="m.json")
    msg = str(err.value)
    assert "\n" not in msg and "schema_version 4" in msg and "vllm-deltasync>=0.7.0" in msg
    assert "reads format versions 1, 2, 3" in msg


@pytest.mark.parametrize(("encoding", "version"), [("sparse-v9", 1), ("dense", 2)])
def test_unknown_codec_or_codec_version_is_refused(encoding: str, version: int) -> None:
    doc = json.loads(make_v2().to_json())
    doc["tensors"][0].update(encoding=encoding, codec_version=version)
    doc["requires"] = "vllm-deltasync>=0.9.0"
    with pytest.raises(FormatError) as err:
        Manifest.from_json(json.dumps(doc).encode(), source="m.json")
    msg = str(err.value)
    assert "\n" not in msg and f"{encoding!r} version {version}" in msg and ">=0.9.0" in msg


@pytest.mark.parametrize("mutate", [
    lambda d: d["tensors"][0]["chunks"][0].update(region=[10, 20]),           # past the tensor
    lambda d: d["tensors"][0]["chunks"][0].update(region=[0, 2, 6, 5]),       # row_len > stride
    lambda d: d["tensors"][0]["chunks"][0].update(count=21),                  # more than region
    lambda d: d["tensors"][0]["chunks"][0]["roles"]["values"].update(offset=100),  # past file
    lambda d: d["tensors"][0]["chunks"][0]["roles"]["values"].update(dtype="F32"),
    lambda d: d["tensors"][0]["chunks"][0].update(sha256="zz"),
    lambda d: d["files"][0].update(index={"w": [[0, 40]]}),                  # index disagrees
    lambda d: d.update(writer="Not-Hex"),
    lambda d: d.pop("run_id"),
])
def test_v2_structural_defects_are_refused(mutate: object) -> None:
    doc = json.loads(make_v2().to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(FormatError, match="m.json"):
        Manifest.from_json(json.dumps(doc).encode(), source="m.json")
