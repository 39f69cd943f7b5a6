"""The committed corpus of hostile files: each is refused with the right error, promptly,
in bounded memory, and nothing in it is ever executed."""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.container import ContainerReader
from inshrinkerator.tree import unflatten

CORPUS = Path(__file__).resolve().parents[1] / "attack_files"
EXPECTED: dict[str, dict[str, str]] = json.loads((CORPUS / "expected.json").read_text())


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_attack_files", CORPUS / "make_attack_files.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()


def read_with_container_reader(path: Path) -> Any:
    """Open, decode every tensor (no references) and rebuild: the low-level entry point."""
    with open(path, "rb") as handle, ContainerReader(handle, str(path)) as reader:
        tensors = [reader.decode(record) for record in reader.header.tensors]
        return unflatten(reader.header.skeleton, tensors)


ENTRY_POINTS: dict[str, Callable[[Path], Any]] = {
    "ink.load": ink.load,
    "ContainerReader": read_with_container_reader,
}


def test_the_corpus_matches_its_script() -> None:
    on_disk = {p.name for p in CORPUS.iterdir() if p.is_file()} - {"make_attack_files.py", "expected.json"}
    assert on_disk == set(EXPECTED) == set(SCRIPT.corpus())
    for name, (_, error, pattern) in SCRIPT.corpus().items():
        assert EXPECTED[name] == {"error": error, "match": pattern}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attack_file_is_refused_cleanly(name: str, entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a pickle payload, if it ever ran, would create its marker here
    path = CORPUS / name
    expected = EXPECTED[name]
    started = time.perf_counter()
    if expected["error"] == "ok":
        state = ENTRY_POINTS[entry](path)
        check_valid_odd_file(name, state)
    else:
        with pytest.raises(ink.InkError) as caught:
            ENTRY_POINTS[entry](path)
        error = caught.value
        if not (entry == "ContainerReader" and name == "delta_without_base.ink"):
            assert type(error).__name__ == expected["error"], str(error)
        assert re.search(expected["match"], str(error)), str(error)
        assert str(path) in str(error), "the message names the file"
    assert time.perf_counter() - started < 2.0
    assert not (tmp_path / SCRIPT.MARKER).exists()


def check_valid_odd_file(name: str, state: Any) -> None:
    if name == "odd_unicode_keys.ink":
        keys = SCRIPT.odd_unicode_state_keys()
        assert list(state) == ["w"] + keys
        assert [state[k] for k in keys] == keys
        assert torch.equal(state["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    elif name == "pickle_as_section_data.ink":
        assert bytes(state["w"].numpy()) == SCRIPT.pickle_payload() and state["step"] == 7
    else:
        raise AssertionError(f"no check for valid file {name}")


def test_the_pickle_payloads_are_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the payload really creates its marker when unpickled, so the absence of the
    marker above means the reader never unpickled anything."""
    monkeypatch.chdir(tmp_path)
    pickle.loads((CORPUS / "pickle_payload.pkl").read_bytes())  # our own corpus file, on purpose
    assert (tmp_path / SCRIPT.MARKER).exists()


def test_the_whole_corpus_stays_within_a_small_memory_budget() -> None:
    """Peak RSS growth of a fresh process that opens every corpus file, both entry points."""
    code = f"""
import json, resource, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
import inshrinkerator as ink
import test_attack_files as t
corpus = Path({str(CORPUS)!r})
t.ENTRY_POINTS["ink.load"](corpus / "odd_unicode_keys.ink")  # warm up lazy imports
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name in sorted(t.EXPECTED):
    for entry in t.ENTRY_POINTS.values():
        try:
            entry(corpus / name)
        except ink.InkError:
            pass
print(json.dumps({{"growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=CORPUS.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    growth_mib = json.loads(result.stdout.strip().splitlines()[-1])["growth_kib"] / 1024
    assert growth_mib < 64, f"opening the corpus grew the peak RSS by {growth_mib:.0f} MiB"


_BOMB_CHILD = """
import json, resource, struct, sys, zlib, io
import torch, zstandard
from inshrinkerator.codecs.registry import get_codec, registered_codecs
from inshrinkerator.container import ContainerReader
from inshrinkerator.errors import InkError
sys.path.insert(0, {script_dir!r})
from make_attack_files import forge, aligned

ENTROPY_HEADER = struct.Struct("<IQI")
bomb = zstandard.ZstdCompressor(level=1).compress(bytes(256 << 20))  # ~8 KiB -> 256 MiB
tensor = torch.linspace(-1, 1, 4096)
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = {{}}
for codec_id, cls in sorted(registered_codecs().items()):
    try:
        codec = cls()
        reference = tensor + 1e-3 if cls.uses_reference else None
        encoded = codec.encode(tensor, reference)
    except Exception:
        continue
    streams = [bytes(memoryview(s).cast("B")) for s in encoded.streams]
    for index, stream in enumerate(streams):
        if len(stream) < ENTROPY_HEADER.size:
            continue
        alphabet, count, table = ENTROPY_HEADER.unpack(stream[:ENTROPY_HEADER.size])
        if count != tensor.numel() or ENTROPY_HEADER.size + table > len(stream):
            continue
        # an order-0 entropy stream: swap its zstd count table for a bomb
        streams[index] = ENTROPY_HEADER.pack(alphabet, count, len(bomb)) + bomb + stream[ENTROPY_HEADER.size + table:]
        sections, body, cursor = [], b"", 0
        for s in streams:
            offset = aligned(cursor)
            body += bytes(offset - cursor) + s
            sections.append([offset, len(s), zlib.crc32(s)])
            cursor = offset + len(s)
        doc = {{"format": "inshrinkerator", "data_bytes": cursor, "skeleton": {{"t": 0}}, "meta": {{}},
               "tensors": [{{"dtype": "float32", "shape": [4096], "codec": codec.get_config(),
                            "params": json.loads(json.dumps(encoded.params)), "sections": sections}}]}}
        outcome = "decoded"
        try:
            with ContainerReader(io.BytesIO(forge(doc, body)), "bomb.ink") as reader:
                reader.decode(reader.header.tensors[0], reference)
        except InkError as exc:
            outcome = type(exc).__name__
        growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) >> 10
        report[codec_id] = [outcome, growth]
        break
print(json.dumps(report))
"""


def test_zstd_bombs_inside_entropy_coded_streams_stay_bounded() -> None:
    """A forged entropy stream whose zstd count table claims 256 MiB must be refused without
    allocating it, whichever registered codec carries it."""
    code = _BOMB_CHILD.format(script_dir=str(CORPUS))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report, "no registered codec carries an order-0 entropy stream"
    for codec_id, (outcome, growth_mib) in report.items():
        assert outcome != "decoded", codec_id
        assert growth_mib < 64, f"{codec_id}: a forged 8 KiB count table grew the peak RSS by {growth_mib} MiB"
