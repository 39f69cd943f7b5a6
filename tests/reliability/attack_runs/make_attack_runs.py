"""Write the committed corpus of hostile run files: a golden run and the files that attack it.

Run ``python tests/reliability/attack_runs/make_attack_runs.py`` to (re)write it next to
this script; tests never regenerate it. ``base_run/`` is a run of steps 0..5
(``full_every=3``: 0 and 3 full, the others deltas) whose tensors are stored raw or as a
raw XOR delta, formats that do not change. Each attack replaces (or adds) one file of a
copy of it; ``expected.json`` says which file, which step to load, the error that load
must raise (class name and a regex its message matches, or ``"ok"``) and a regex that a
line of ``verify_run`` must match. Sealed attacks carry a correct checksum (an attacker
can compute one), so they reach the validation step they target.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
BASE = "base_run"
TARGET = "step-0000000004.json"  # a delta against step 3; step 5 is a delta against it


def build_base_run(folder: Path) -> None:
    import torch

    from inshrinkerator.codecs import RawCodec, XorDeltaCodec
    from inshrinkerator.policies import Policy
    from inshrinkerator.store import CheckpointManager

    sys.path.insert(0, str(HERE.parents[2]))
    from tests.reliability.run_damage import step_state

    class RawDeltaPolicy(Policy):
        """Raw tensors, or a raw XOR delta against the previous step: formats that never change."""

        name = "raw-delta"

        def plan(self, leaves: Sequence[Any], references: Sequence[Optional[torch.Tensor]]) -> list[Any]:
            return [
                XorDeltaCodec(inner=RawCodec().get_config())
                if ref is not None and ref.dtype == leaf.tensor.dtype and ref.shape == leaf.tensor.shape
                else RawCodec()
                for leaf, ref in zip(leaves, references)
            ]

    if folder.exists():
        shutil.rmtree(folder)
    with CheckpointManager(folder, policy=RawDeltaPolicy(), full_every=3) as manager:
        for step in range(6):
            manager.save(step, step_state(step))


def _manifest(step: int) -> dict[str, Any]:
    return json.loads((HERE / BASE / f"step-{step:010d}.json").read_bytes())


def _sealed(document: dict[str, Any]) -> bytes:
    from inshrinkerator.store.manifest import _sealed as seal

    return json.dumps(seal(document), indent=1).encode()


def _with(**changes: Any) -> bytes:
    document = _manifest(4)
    document.update(changes)
    return _sealed(document)


def _unsealed_with(**changes: Any) -> bytes:
    document = _manifest(4)
    document.update(changes)
    return json.dumps(document, indent=1).encode()


def _pickle_payload() -> bytes:
    sys.path.insert(0, str(HERE.parents[1]))
    from attack_files.make_attack_files import pickle_payload

    return pickle_payload()


def _marker(**changes: Any) -> bytes:
    document = json.loads((HERE / BASE / "inshrink-run.json").read_bytes())
    document.update(changes)
    from inshrinkerator.store.manifest import _sealed as seal

    return json.dumps(seal(document)).encode()


Attack = tuple[Callable[[], bytes], str, int, str, str, str]  # bytes, file, step, error, match, verify


def corpus() -> dict[str, Attack]:
    """Attack file name -> (builder, file it replaces or adds, step loaded, error, message regex, verify regex)."""
    data_4 = _manifest(4)["data_file"]
    corrupt = "CorruptCheckpointError"
    return {
        # -- not a manifest at all
        "pickle_payload.json": (_pickle_payload, TARGET, 4, corrupt, "not valid JSON", "step 4: CorruptCheckpointError"),
        "empty.json": (lambda: b"", TARGET, 5, corrupt, "not valid JSON", "step 4: .*not valid JSON"),
        "utf16.json": (lambda: json.dumps(_manifest(4)).encode("utf-16"), TARGET, 4, corrupt, "not valid JSON", "step 4"),
        "truncated.json": (lambda: _sealed(_manifest(4))[:100], TARGET, 4, corrupt, "not valid JSON", "step 4"),
        "deep_nesting.json": (lambda: b"[" * 20_000 + b"]" * 20_000, TARGET, 4, corrupt, "not valid JSON", "step 4"),
        "huge_int.json": (lambda: _unsealed_with(step=0).replace(b'"step": 0', b'"step": 1' + b"0" * 5000),
                          TARGET, 4, corrupt, "not valid JSON", "step 4"),
        "not_an_object.json": (lambda: b"[]", TARGET, 4, corrupt, "not an inshrinkerator step manifest", "step 4"),
        "wrong_format.json": (lambda: _with(format="inshrinkerator-run"), TARGET, 4, corrupt, "not an inshrinkerator step", "step 4"),
        "version_2.json": (lambda: _with(version=2), TARGET, 4, "FormatError", "version 2 is not supported", "step 4: FormatError"),
        # -- a manifest that lies about its step or its file
        "other_step.json": (lambda: (HERE / BASE / "step-0000000003.json").read_bytes(), TARGET, 4, corrupt,
                            "describes step 3, its name says 4", "step 4"),
        "path_traversal.json": (lambda: _with(data_file="../../etc/passwd"), TARGET, 4, corrupt, "not a data file", "step 4"),
        "absolute_path.json": (lambda: _with(data_file="/etc/passwd"), TARGET, 4, corrupt, "not a data file", "step 4"),
        "url_data_file.json": (lambda: _with(data_file=f"s3://elsewhere/{data_4}"), TARGET, 4, corrupt, "not a data file", "step 4"),
        "other_steps_data.json": (lambda: _with(data_file=_manifest(3)["data_file"]), TARGET, 4, corrupt,
                                  "not a data file of step 4", "step 4"),
        "missing_data_file.json": (lambda: _with(data_file="step-0000000004-ffffffff.ink"), TARGET, 5, "BrokenChainError",
                                   "data file of step 4 is missing, and step 5 is stored against it", "step 4: .*missing"),
        "wrong_size.json": (lambda: _with(data_bytes=_manifest(4)["data_bytes"] + 1), TARGET, 4, corrupt,
                            "does not match the manifest", "step 4"),
        # -- a chain that does not hold together
        "base_in_future.json": (lambda: _with(base_step=5), TARGET, 4, corrupt, "base step below 4", "step 4"),
        "base_self.json": (lambda: _with(base_step=4), TARGET, 4, corrupt, "base step below 4", "step 4"),
        "base_negative.json": (lambda: _with(base_step=-1), TARGET, 4, corrupt, "base step below 4", "step 4"),
        "base_bool.json": (lambda: _with(base_step=True), TARGET, 4, corrupt, "base step below 4", "step 4"),
        "base_nan.json": (lambda: _unsealed_with(base_step=0).replace(b'"base_step": 0', b'"base_step": NaN'),
                          TARGET, 4, corrupt, "base step below 4", "step 4"),
        "wrong_base.json": (lambda: _with(base_step=2), TARGET, 4, "BrokenChainError", "reference", "step 4: BrokenChainError"),
        "full_with_base.json": (lambda: _with(kind="full"), TARGET, 4, corrupt, "a full checkpoint has no base step", "step 4"),
        "kind_unknown.json": (lambda: _with(kind="partial"), TARGET, 4, corrupt, "neither 'full' nor 'delta'", "step 4"),
        "delta_relabelled_full.json": (lambda: _with(kind="full", base_step=None), TARGET, 5, "BrokenChainError",
                                       "delta against 'step 3', which was not given", "step 4: BrokenChainError"),
        # -- damage that keeps the JSON valid
        "checksum_wrong.json": (lambda: _sealed(_manifest(4)).replace(b'"created": "', b'"created": "1'), TARGET, 4,
                                corrupt, "checksum", "step 4: .*checksum"),
        "unknown_field.json": (lambda: _with(exec="__import__('os').system('true')"), TARGET, 4, corrupt,
                               "unknown fields", "step 4"),
        "duplicate_keys.json": (lambda: _sealed(_manifest(4)).replace(b'\n "step": 4,', b'\n "step": 4,\n "step": 4,'),
                                TARGET, 4, corrupt, "checksum", "step 4"),
        # -- odd files in the folder
        "step_max.json": (lambda: b"garbage", "step-99999999999999999999.json", 99999999999999999999, corrupt,
                          "not valid JSON", "step 99999999999999999999"),
        # -- the run marker: readers never need it; verify reports it
        "marker_pickle.json": (_pickle_payload, "inshrink-run.json", 5, "ok", "", "run marker: .*not valid JSON"),
        "marker_version_2.json": (lambda: _marker(version=2), "inshrink-run.json", 5, "ok", "",
                                  "run marker: FormatError: .*run version 2 is not supported"),
        "marker_checksum.json": (lambda: _marker(created="1999-01-01T00:00:00+00:00").replace(b"1999", b"2999"),
                                 "inshrink-run.json", 5, "ok", "", "run marker: .*checksum"),
    }


def main(directory: Path = HERE) -> None:
    build_base_run(directory / BASE)
    expected = {}
    for name, (build, target, step, error, pattern, verify) in corpus().items():
        (directory / name).write_bytes(build())
        expected[name] = {"file": target, "step": step, "error": error, "match": pattern, "verify": verify}
    (directory / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {BASE}/ and {len(expected)} attack files to {directory}", file=sys.stderr)


if __name__ == "__main__":
    main()
