"""Golden files pin the .ink format: the committed bytes must keep decoding to the same state."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.container.format import FORMAT_VERSION, MAGIC, PREAMBLE, unpack_header
from inshrinkerator.single_file import open_container

from ..test_tree import assert_exact

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "container"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()


ALL = {**SCRIPT.GOLDEN, **SCRIPT.LEGACY}


def test_every_golden_file_is_committed() -> None:
    assert {p.name for p in GOLDEN_DIR.glob("*.ink")} == set(ALL)


@pytest.mark.parametrize("name", sorted(ALL))
def test_golden_file_decodes_to_its_state(name: str) -> None:
    make_state, make_base = ALL[name]
    base = make_base() if make_base else None
    assert_exact(make_state(), ink.load(GOLDEN_DIR / name, base=base))


@pytest.mark.parametrize("name", sorted(ALL))
def test_golden_file_layout(name: str) -> None:
    data = (GOLDEN_DIR / name).read_bytes()
    magic, version, flags, header_length, _, reserved = PREAMBLE.unpack(data[: PREAMBLE.size])
    expected_version = int(name[1]) if name in SCRIPT.LEGACY else FORMAT_VERSION
    assert (magic, version, flags, reserved) == (MAGIC, expected_version, 0, 0)
    header = json.loads(unpack_header(data[PREAMBLE.size : PREAMBLE.size + header_length], version, name))
    assert header["format"] == "inshrinkerator" and header["meta"]["policy"] == "lossless"
    with open_container(GOLDEN_DIR / name) as reader:
        assert reader.version == expected_version
        assert reader.verify() == sum(r.stored_bytes for r in reader.header.tensors)


def test_golden_files_from_version_2_on_have_no_padding() -> None:
    for name in [*SCRIPT.GOLDEN, *(name for name in SCRIPT.LEGACY if name.startswith("v2_"))]:
        with open_container(GOLDEN_DIR / name) as reader:
            stored = sum(r.stored_bytes for r in reader.header.tensors)
            assert all(section.padding == 0 for r in reader.header.tensors for section in r.sections)
            assert reader.file_bytes == reader.data_start + stored
            assert reader.data_start == PREAMBLE.size + PREAMBLE.unpack((GOLDEN_DIR / name).read_bytes()[:32])[3]


def test_golden_files_cover_every_codec_the_lossless_policy_writes() -> None:
    used = set()
    for name in SCRIPT.GOLDEN:
        with open_container(GOLDEN_DIR / name) as reader:
            used |= {record.codec["id"] for record in reader.header.tensors}
            used |= {record.codec.get("inner", {}).get("id") for record in reader.header.tensors} - {None}
    assert {"raw", "byte_grouping", "xor_delta"} <= used


def test_the_delta_golden_file_needs_its_base() -> None:
    with pytest.raises(ink.BrokenChainError):
        ink.load(GOLDEN_DIR / "tuned_with_base.ink")
    wrong = SCRIPT.base_state()
    wrong["w"] = wrong["w"].clone()
    wrong["w"][0, 0] += 1
    with pytest.raises(ink.BrokenChainError):
        ink.load(GOLDEN_DIR / "tuned_with_base.ink", base=wrong)


def test_expected_states_are_built_from_exact_integer_arithmetic() -> None:
    """The expected values must not drift: spot-check a few bit patterns."""
    state = SCRIPT.full_state()
    assert state["model"]["head.weight"] is state["model"]["embed.weight"]
    bits = state["specials"].view(torch.int32)
    assert [int(b) & 0xFFFFFFFF for b in bits[:3]] == [0x7FC00000, 0xFFC00000, 0x7F800001]
    assert int(SCRIPT.hashed(3, 0)[2]) == int(SCRIPT.hashed(5, 0)[2])  # position-wise, no state
    assert int(SCRIPT.weights((4,), 2).view(torch.int32)[0]) == int(SCRIPT.weights((9,), 2).view(torch.int32)[0])


def test_version_3_files_are_the_version_2_files_without_section_offsets() -> None:
    for name in SCRIPT.GOLDEN:
        current, older = (GOLDEN_DIR / name).read_bytes(), (GOLDEN_DIR / f"v2_{name}").read_bytes()
        headers = []
        for data in (current, older):
            version, header_length = PREAMBLE.unpack(data[: PREAMBLE.size])[1:4:2]
            headers.append(json.loads(unpack_header(data[PREAMBLE.size : PREAMBLE.size + header_length], version, name)))
            headers[-1]["data"] = data[PREAMBLE.size + header_length :]
        for record in headers[1]["tensors"]:
            record["sections"] = [entry[1:] for entry in record["sections"]]
        assert headers[0] == headers[1]  # the same records and data, less the offsets
        assert len(current) < len(older)
