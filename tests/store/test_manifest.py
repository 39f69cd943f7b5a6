"""Step manifests: names, the stored_bytes fixed point, and validation of untrusted bytes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inshrinkerator.errors import FormatError
from inshrinkerator.store.manifest import (
    StepManifest,
    data_name,
    encode_manifest,
    manifest_name,
    parse_manifest,
    step_of_data_name,
    step_of_manifest_name,
)

MANIFEST = StepManifest(
    step=12, kind="delta", base_step=11, data_file=data_name(12, "0123abcd"), data_bytes=5000,
    raw_bytes=9000, stored_bytes=0, policy="lossless", created="2026-01-01T00:00:00+00:00",
)


@given(st.integers(0, 10**20 - 1), st.text("0123456789abcdef", min_size=8, max_size=32))
def test_names_round_trip(step: int, token: str) -> None:
    assert step_of_manifest_name(manifest_name(step)) == step
    assert step_of_data_name(data_name(step, token)) == step


@pytest.mark.parametrize("name", [
    "step-12.json", "step-0000000012.json.tmp", ".tmp-step-0000000012.json.x1", "step-00000000012.json",
    "step-0000000012-XYZ.ink", "step-0000000012-0123abcd.ink.part", "../step-0000000012.json", "inshrink-run.json",
])
def test_other_names_are_not_steps(name: str) -> None:
    assert step_of_manifest_name(name) is None and step_of_data_name(name) is None


@given(st.integers(0, 10**12), st.integers(0, 10**12))
def test_stored_bytes_is_data_plus_the_manifest_itself(data_bytes: int, raw_bytes: int) -> None:
    final, blob = encode_manifest(replace(MANIFEST, data_bytes=data_bytes, raw_bytes=raw_bytes))
    assert final.stored_bytes == data_bytes + len(blob)
    assert parse_manifest(blob, "m", 12) == final


def _mutated(**changes) -> bytes:
    document = json.loads(MANIFEST.to_json())
    document.update(changes)
    return json.dumps(document).encode()


@pytest.mark.parametrize("changes, message", [
    ({"step": 13}, "name says 12"),
    ({"kind": "partial"}, "neither"),
    ({"kind": "full"}, "no base step"),
    ({"base_step": 12}, "base step below 12"),
    ({"base_step": None}, "base step below"),
    ({"data_file": "../../etc/passwd"}, "not a data file"),
    ({"data_file": data_name(13, "0123abcd")}, "not a data file of step 12"),
    ({"data_bytes": -1}, "data_bytes"),
    ({"raw_bytes": True}, "raw_bytes"),
    ({"policy": 3}, "wrong type"),
    ({"format": "something-else"}, "not an inshrinkerator step manifest"),
    ({"version": 99}, "version 99"),
])
def test_bad_manifests_are_refused_with_a_reason(changes, message) -> None:
    with pytest.raises(FormatError, match=message):
        parse_manifest(_mutated(**changes), "run/step-0000000012.json", 12)


@given(st.binary(max_size=300))
def test_garbage_never_crashes_the_parser(blob: bytes) -> None:
    try:
        parse_manifest(blob, "m", 12)
    except FormatError:
        pass


def test_oversized_manifest_is_refused() -> None:
    with pytest.raises(FormatError, match="too large"):
        parse_manifest(b" " * (2 << 20), "m", 12)
