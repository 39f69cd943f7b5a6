"""The files of a run: their names, and the per-step manifest that commits a step.

A run is one flat folder (a local directory or an fsspec prefix)::

    inshrink-run.json                      run marker: says "this folder is a run"
    step-0000000120.json                   manifest of step 120: the commit marker
    step-0000000120-3fa9c2d1.ink           its data (a .ink container); the token is new
                                           for every write, so a rewrite never
                                           overwrites a file a reader may hold open
    .tmp-...                               temporaries of an unfinished write (local only)

A step exists exactly when its manifest exists. The manifests together are the run's
index: listing them lists the committed steps, reading one gives a step's kind, its
base step and its sizes.

Manifests and the run marker are sealed: a ``crc32`` field (8 hex digits) holds the
CRC-32 of the other fields in canonical JSON, and a reader accepts the file only if
sealing what it parsed gives back exactly the bytes it read. Any damaged byte is then
detected, including those of fields a restore never uses (``created``, ``policy``).
Files written before the seal existed (no ``crc32`` field) are still read.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any, Literal, Optional

from ..errors import CorruptCheckpointError, FormatError

__all__ = [
    "RUN_MARKER",
    "MAX_MANIFEST_BYTES",
    "StepManifest",
    "manifest_name",
    "data_name",
    "step_of_manifest_name",
    "step_of_data_name",
    "encode_manifest",
    "parse_manifest",
    "run_marker_bytes",
    "parse_run_marker",
    "utc_now",
]

RUN_MARKER = "inshrink-run.json"
RUN_FORMAT = "inshrinkerator-run"
MANIFEST_FORMAT = "inshrinkerator-step"
MANIFEST_VERSION = 1
#: A manifest is a few hundred bytes; anything far larger is not one.
MAX_MANIFEST_BYTES = 1 << 20
#: Steps are non-negative and fit in 20 decimal digits.
MAX_STEP = 10**20 - 1

_MANIFEST_NAME = re.compile(r"step-(\d{10,20})\.json")
_DATA_NAME = re.compile(r"step-(\d{10,20})-([0-9a-f]{8,32})\.ink")


def manifest_name(step: int) -> str:
    """``step-0000000120.json`` for step 120."""
    return f"step-{step:010d}.json"


def data_name(step: int, token: str) -> str:
    """``step-0000000120-<token>.ink``: the data file of one write of ``step``."""
    return f"step-{step:010d}-{token}.ink"


def step_of_manifest_name(name: str) -> Optional[int]:
    """The step a manifest file name commits, or ``None`` if ``name`` is not one."""
    match = _MANIFEST_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if manifest_name(step) == name else None


def step_of_data_name(name: str) -> Optional[int]:
    """The step a data file name belongs to, or ``None`` if ``name`` is not one."""
    match = _DATA_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if data_name(step, match.group(2)) == name else None


def utc_now() -> str:
    """The current time as an ISO-8601 string in UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _sealed(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with its ``crc32`` field (re)computed over the other fields, placed last."""
    body = {key: value for key, value in document.items() if key != "crc32"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return {**body, "crc32": f"{zlib.crc32(canonical):08x}"}


def _check_seal(
    document: dict[str, Any], blob: bytes, indent: Optional[int], fields: frozenset[str], source: str
) -> None:
    """Refuse unknown fields, and a sealed document whose bytes are not what its writer wrote."""
    unknown = sorted(set(document) - fields)
    if unknown:
        raise CorruptCheckpointError(
            f"{source}: unknown fields {str(unknown)[:80]}; the file was damaged or written by "
            "a newer inshrinkerator"
        )
    if "crc32" in document and json.dumps(_sealed(document), indent=indent).encode("utf-8") != blob:
        raise CorruptCheckpointError(
            f"{source}: the bytes do not match the file's checksum; the run was damaged — "
            "restore this file from a copy, or delete it (a step manifest: the step is dropped)"
        )


_MARKER_FIELDS = frozenset({"format", "version", "created", "crc32"})


def run_marker_bytes() -> bytes:
    marker = {"format": RUN_FORMAT, "version": MANIFEST_VERSION, "created": utc_now()}
    return json.dumps(_sealed(marker)).encode()


def parse_run_marker(blob: bytes, source: str) -> None:
    """Check a run marker's bytes (readers never need its content; ``inshrink verify`` checks it).

    Raises:
        CorruptCheckpointError: damaged; FormatError: a marker of an unsupported version.
    """
    if len(blob) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{source}: {len(blob)} bytes is too large for a run marker")
    try:
        document = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{source}: run marker is not valid JSON ({str(exc)[:80]})"
        ) from None
    if not isinstance(document, dict) or document.get("format") != RUN_FORMAT:
        raise CorruptCheckpointError(f"{source}: not an inshrinkerator run marker")
    if document.get("version") != MANIFEST_VERSION:
        raise FormatError(
            f"{source}: run version {document.get('version')!r} is not supported (this build reads "
            f"version {MANIFEST_VERSION}); upgrade inshrinkerator"
        )
    if not isinstance(document.get("created"), str):
        raise CorruptCheckpointError(f"{source}: run marker field 'created' is not a string")
    _check_seal(document, blob, None, _MARKER_FIELDS, source)


@dataclass(frozen=True)
class StepManifest:
    """What a run knows about one committed step.

    Attributes:
        step: the training step.
        kind: ``"full"`` (decodes on its own) or ``"delta"`` (decodes against ``base_step``).
        base_step: the step whose reconstruction this delta was taken against.
        data_file: name of the ``.ink`` file in the run folder.
        data_bytes: size of that file.
        raw_bytes: bytes of the tensors of the state handed to ``save``.
        stored_bytes: data file plus this manifest, in bytes.
        policy: the policy that wrote the data.
        created: when the step was first saved (ISO-8601, UTC).
        rebased: True when retention rewrote a delta as a full checkpoint.
    """

    step: int
    kind: Literal["full", "delta"]
    base_step: Optional[int]
    data_file: str
    data_bytes: int
    raw_bytes: int
    stored_bytes: int
    policy: str
    created: str
    rebased: bool = False

    def to_json(self) -> bytes:
        document = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **asdict(self)}
        return json.dumps(_sealed(document), indent=1).encode("utf-8")


_MANIFEST_FIELDS = frozenset({"format", "version", "crc32", *StepManifest.__dataclass_fields__})


def encode_manifest(manifest: StepManifest) -> tuple[StepManifest, bytes]:
    """Fill in ``stored_bytes`` (data file + the manifest's own size) and serialize.

    The manifest's size depends on the number written into it, so iterate to the
    fixed point; it is reached in one or two rounds.
    """
    current = replace(manifest, stored_bytes=manifest.data_bytes)
    blob = current.to_json()
    while True:
        current = replace(manifest, stored_bytes=manifest.data_bytes + len(blob))
        again = current.to_json()
        if len(again) == len(blob):
            return current, again
        blob = again


def _uint(document: dict[str, Any], key: str, source: str) -> int:
    value = document.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP * 1000:
        raise CorruptCheckpointError(f"{source}: manifest field {key!r} is {value!r}, not a size or step")
    return value


def parse_manifest(blob: bytes, source: str, expected_step: int) -> StepManifest:
    """Validate a manifest's bytes; :class:`CorruptCheckpointError` names what is wrong.

    ``expected_step`` is the step its file name says; a manifest that names another
    step or a data file of another step is rejected (no path in a manifest can point
    outside the run folder: data names must match the data-file pattern).
    """
    if len(blob) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{source}: {len(blob)} bytes is too large for a step manifest")
    try:
        document = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{source}: step manifest is not valid JSON ({str(exc)[:80]}); the run was damaged — "
            "delete this manifest to drop the step"
        ) from None
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpointError(f"{source}: not an inshrinkerator step manifest")
    if document.get("version") != MANIFEST_VERSION:
        raise FormatError(
            f"{source}: step manifest version {document.get('version')!r} is not supported "
            f"(this build reads version {MANIFEST_VERSION}); upgrade inshrinkerator"
        )
    step = _uint(document, "step", source)
    kind = document.get("kind")
    base_step = document.get("base_step")
    data_file = document.get("data_file")
    policy, created, rebased = document.get("policy"), document.get("created"), document.get("rebased", False)
    if step != expected_step:
        raise CorruptCheckpointError(f"{source}: manifest describes step {step}, its name says {expected_step}")
    if kind == "full":
        if base_step is not None:
            raise CorruptCheckpointError(f"{source}: a full checkpoint has no base step")
    elif kind == "delta":
        if not isinstance(base_step, int) or isinstance(base_step, bool) or not 0 <= base_step < step:
            raise CorruptCheckpointError(f"{source}: a delta needs a base step below {step}")
    else:
        raise CorruptCheckpointError(f"{source}: kind {kind!r} is neither 'full' nor 'delta'")
    if not isinstance(data_file, str) or step_of_data_name(data_file) != step:
        raise CorruptCheckpointError(f"{source}: data file {str(data_file)[:80]!r} is not a data file of step {step}")
    if not isinstance(policy, str) or not isinstance(created, str) or not isinstance(rebased, bool):
        raise CorruptCheckpointError(f"{source}: policy, created or rebased has the wrong type")
    manifest = StepManifest(
        step=step,
        kind=kind,
        base_step=base_step,
        data_file=data_file,
        data_bytes=_uint(document, "data_bytes", source),
        raw_bytes=_uint(document, "raw_bytes", source),
        stored_bytes=_uint(document, "stored_bytes", source),
        policy=policy,
        created=created,
        rebased=rebased,
    )
    _check_seal(document, blob, 1, _MANIFEST_FIELDS, source)
    return manifest
