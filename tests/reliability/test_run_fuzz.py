"""Fuzzing of runs: damaged, truncated and forged manifests, run markers and data files.

Every damaged copy of a run must behave as :func:`~.run_damage.expected_damage` says:
each listed step either loads exactly what was saved or raises a reader error (never
another exception, never a hang, never different data), every step that a damage
breaks is reported by ``verify_run``, and no other step is. Forged manifests (valid
JSON with a correct checksum: an attack, not damage) may load, but only exactly what
was saved.

The CI budget is a few hundred inputs; ``INSHRINK_FUZZ_EXAMPLES=5000 pytest
tests/reliability/test_run_fuzz.py -s`` runs a long campaign and prints the figures.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inshrinkerator.errors import FormatError
from inshrinkerator.store import CheckpointManager, verify_run
from inshrinkerator.store.manifest import (
    RUN_MARKER,
    StepManifest,
    data_name,
    encode_manifest,
    manifest_name,
    parse_manifest,
)

from ..helpers import assert_same
from .run_damage import (
    READER_ERRORS,
    Damage,
    RunFiles,
    copy_run,
    expected_damage,
    snapshot_files,
    step_state,
)

_LONG = int(os.environ.get("INSHRINK_FUZZ_EXAMPLES", "0"))


def budget(ci_examples: int) -> settings:
    return settings(
        max_examples=_LONG or ci_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        database=None,
    )


#: A load of one step of the template takes a few milliseconds; this is for a loaded machine.
PROMPT_SECONDS = 5.0
DAMAGE_KINDS = ("flip", "flip", "flip", "truncate", "extend", "overwrite", "splice", "delete", "directory")


def damages(names: list[str]) -> st.SearchStrategy[list[Damage]]:
    one = st.builds(
        Damage,
        how=st.sampled_from(DAMAGE_KINDS),
        target=st.sampled_from(names),
        position=st.integers(0, 1 << 20),
        value=st.integers(1, 255),
        payload=st.one_of(
            st.binary(max_size=48),
            st.sampled_from([b"{}", b"null", b"[]", b'{"format": "inshrinkerator-step"}', b"\x80\x04N."]),
        ),
    )
    return st.lists(one, min_size=1, max_size=3)


def _problem_steps(problems: list[str]) -> set[int]:
    steps = set()
    for line in problems:
        if line.startswith("step "):
            steps.add(int(line.split(":")[0].removeprefix("step ")))
    return steps


def check_readers(folder: Path, expected_loads: dict[int, bool], tally: Any) -> None:
    """Each listed step loads exactly (``True``) or raises a reader error (``False``: must fail;
    ``None``: may fail)."""
    reader = CheckpointManager(folder)
    assert set(reader.steps()) == set(expected_loads)
    for step, must_load in expected_loads.items():
        started = time.perf_counter()
        try:
            state = reader.load(step)
        except READER_ERRORS as exc:
            assert must_load is not True, f"step {step} was not damaged but failed: {exc!r}"
            assert str(folder) in str(exc), f"the message names the run: {exc}"
            tally["refused loads"] += 1
        else:
            assert must_load is not False, f"step {step} was damaged but loaded"
            assert_same(state, step_state(step))  # never different data
            tally["exact loads"] += 1
        assert time.perf_counter() - started < PROMPT_SECONDS


@budget(ci_examples=80)
@given(data=st.data())
def test_damaged_runs_fail_cleanly_and_verify_reports_exactly_the_broken_steps(
    template_run: tuple[Path, RunFiles], tally: Any, data: st.DataObject
) -> None:
    template, files = template_run
    names = sorted(snapshot_files(template))
    plan = data.draw(damages(names))
    with tempfile.TemporaryDirectory(prefix="ink-fuzz-") as scratch:
        folder = Path(scratch) / "run"
        copy_run(template, folder)
        before = snapshot_files(folder)
        for damage in plan:
            damage.apply(folder)
        expected = expected_damage(files, before, folder)
        tally["damaged runs"] += 1
        tally["damaged steps"] += len(expected.broken)
        check_readers(folder, {step: step not in expected.broken for step in expected.listed}, tally)
        problems = verify_run(str(folder))
        assert _problem_steps(problems) == expected.broken, problems
        marker_lines = [line for line in problems if line.startswith("run marker")]
        assert bool(marker_lines) == expected.marker_damaged, problems


def _sealed_forgery(document: dict[str, Any]) -> bytes:
    """A manifest an attacker wrote: any fields, a correct checksum."""
    manifest = StepManifest(**{key: document[key] for key in StepManifest.__dataclass_fields__})
    return encode_manifest(manifest)[1]


@budget(ci_examples=50)
@given(data=st.data())
def test_forged_manifests_never_crash_and_never_yield_other_data(
    template_run: tuple[Path, RunFiles], tally: Any, data: st.DataObject
) -> None:
    template, files = template_run
    step = data.draw(st.sampled_from(sorted(files.base)), label="step")
    document = json.loads((template / manifest_name(step)).read_bytes())
    other_files = sorted(files.data_file.values())
    field_values = {
        "kind": st.sampled_from(["full", "delta"]),
        "base_step": st.one_of(st.none(), st.integers(-2, 8)),
        "data_file": st.one_of(
            st.sampled_from(other_files),
            st.just(data_name(step, "0123abcd")),
            st.sampled_from(["../" + other_files[0], "/etc/passwd", f"s3://other/{other_files[0]}", ""]),
        ),
        "data_bytes": st.integers(0, 1 << 40),
        "raw_bytes": st.integers(0, 1 << 40),
        "policy": st.sampled_from(["lossless", "dynaquant", "", "x" * 300]),
        "step": st.integers(0, 8),
    }
    changes: dict[str, Any] = {}
    for key in data.draw(st.lists(st.sampled_from(sorted(field_values)), min_size=1, max_size=3, unique=True)):
        changes[key] = data.draw(field_values[key], label=key)
    document.update(changes)
    with tempfile.TemporaryDirectory(prefix="ink-forge-") as scratch:
        folder = Path(scratch) / "run"
        copy_run(template, folder)
        (folder / manifest_name(step)).write_bytes(_sealed_forgery(document))
        tally["forged manifests"] += 1
        # Any step may now fail (a forged base breaks its dependants), but whatever loads is exact.
        check_readers(folder, {s: None for s in files.base}, tally)
        problems = verify_run(str(folder))
        assert all(isinstance(line, str) for line in problems)


@budget(ci_examples=300)
@given(
    plan=st.lists(
        st.tuples(st.sampled_from(["flip", "truncate", "splice", "extend"]), st.integers(0, 4096), st.binary(max_size=8)),
        min_size=1,
        max_size=4,
    )
)
def test_a_manifest_parses_only_if_its_bytes_are_unchanged(template_run: tuple[Path, RunFiles], tally: Any, plan) -> None:
    template, _ = template_run
    blob = (template / manifest_name(4)).read_bytes()
    original = parse_manifest(blob, "m", 4)
    damaged = blob
    for how, position, payload in plan:
        at = position % len(damaged) if damaged else 0
        if how == "flip" and damaged:
            damaged = damaged[:at] + bytes([damaged[at] ^ (payload[0] if payload and payload[0] else 1)]) + damaged[at + 1 :]
        elif how == "truncate":
            damaged = damaged[:at]
        elif how == "splice":
            damaged = damaged[:at] + payload + damaged[at + len(payload) :]
        else:
            damaged = damaged + (payload or b" ")
    tally["manifest byte mutations"] += 1
    try:
        parsed = parse_manifest(damaged, "m", 4)
    except FormatError:
        assert damaged != blob
        return
    assert damaged == blob, "a changed manifest was accepted"
    assert parsed == original


@budget(ci_examples=150)
@given(document=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30,
))
def test_arbitrary_json_is_never_a_manifest_or_marker_by_accident(template_run, tally: Any, document: Any) -> None:
    from inshrinkerator.store.manifest import parse_run_marker

    blob = json.dumps(document).encode()
    tally["json documents"] += 1
    try:
        parse_manifest(blob, "m", 4)
    except FormatError:
        pass
    else:
        raise AssertionError(f"accepted {blob[:200]!r} as a manifest")
    try:
        parse_run_marker(blob, "marker")
    except FormatError:
        pass
    else:
        raise AssertionError(f"accepted {blob[:200]!r} as a run marker")


def test_the_template_is_what_the_fuzzers_assume(template_run: tuple[Path, RunFiles]) -> None:
    template, files = template_run
    assert files.base == {0: None, 1: 0, 2: 1, 3: None, 4: 3, 5: 4}
    assert set(snapshot_files(template)) == {RUN_MARKER, *map(manifest_name, files.base), *files.data_file.values()}
    assert verify_run(str(template)) == []


NEAR_MISSES = [
    "step-0000000001.json.tmp", "step-1.json", "STEP-0000000001.JSON", "step-00000000001.json",
    "step-0000000001-ABCDEF12.ink", "step-0000000001-0123.ink", ".tmp-step-0000000001.json.x",
    "inshrink-run.json.bak", "step--000000001.json", "step-0000000001.json ", "step-٠٠٠٠٠٠٠٠٠١.json",
]


@budget(ci_examples=40)
@given(
    junk=st.lists(
        st.tuples(
            st.one_of(st.sampled_from(NEAR_MISSES), st.text(min_size=1, max_size=30)),
            st.binary(max_size=64),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_other_files_in_a_run_folder_are_skipped(template_run: tuple[Path, RunFiles], tally: Any, junk) -> None:
    """Files that are neither the marker, a manifest nor a data file a manifest names are not
    part of the run: readers and verify skip them (a writer removes only its own leftovers)."""
    from inshrinkerator.store.manifest import step_of_manifest_name

    template, files = template_run
    with tempfile.TemporaryDirectory(prefix="ink-junk-") as scratch:
        folder = Path(scratch) / "run"
        copy_run(template, folder)
        written = 0
        for name, content in junk:
            if "/" in name or "\0" in name or name in (".", "..") or step_of_manifest_name(name) is not None:
                continue
            if name == RUN_MARKER or name in files.data_file.values() or len(name.encode()) > 200:
                continue
            try:
                (folder / name).write_bytes(content)
            except OSError:
                continue  # a name this filesystem refuses
            written += 1
        tally["junk files"] += written
        check_readers(folder, {step: True for step in files.base}, tally)
        assert verify_run(str(folder)) == []
