"""A full disk (ENOSPC) and failing fsyncs during saves: nothing committed is lost.

The real thing first: a 1 MiB tmpfs is mounted (root only; the test is skipped where
mounting is refused) and filled so that only ``k`` pages are free, for every ``k`` from
0 until a save fits, so the disk runs out at every point of a save (data file, manifest,
re-base of the oldest kept step). Then, without any mount, ENOSPC and EIO are injected
at the storage layer: each ``fsync`` of a save in turn, and writes past a byte budget.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store import storage as storage_module
from inshrinkerator.store.manifest import RUN_MARKER, manifest_name

from ..helpers import assert_same

OPTIONS = {"policy": "lossless", "full_every": 3, "keep_last": 2}
PAGE = 4096


def big_state(step: int) -> dict[str, Any]:
    """About 64 KiB of incompressible weights: a save needs many pages of a small disk."""
    generator = torch.Generator().manual_seed(step)
    return {"weight": torch.randn(16384, generator=generator), "step": step}


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A mounted 1 MiB tmpfs; skipped unless this process may mount one."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point = tmp_path_factory.mktemp("small-disk")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True)


def _fill(disk: Path, leave_bytes: int) -> Path:
    filler = disk / "filler"
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize
    with open(filler, "wb") as handle:
        handle.truncate(0)
        handle.write(b"\xff" * max(free - leave_bytes, 0))
        handle.flush()
        os.fsync(handle.fileno())
    return filler


def _leftovers(run: Path) -> list[str]:
    entries = describe_run(str(run))
    kept = {RUN_MARKER} | {manifest_name(e.step) for e in entries} | {e.data_file for e in entries}
    return sorted(set(os.listdir(run)) - kept)


def _check_after_failure(run: Path, error: OSError) -> bool:
    """Every listed step restores; returns whether step 3 (the one being saved) was committed."""
    steps = CheckpointManager(run).steps()
    notes = " ".join(getattr(error, "__notes__", []))
    committed = 3 in steps
    assert ({2, 3} <= set(steps) <= {1, 2, 3}) if committed else steps == [1, 2], steps
    assert ("was committed" in notes) == committed, notes
    assert not [name for name in os.listdir(run) if name.startswith(".tmp-")], "a temporary was left"
    reader = CheckpointManager(run)
    for step in steps:
        assert_same(reader.load(step), big_state(step))
    assert verify_run(str(run)) == []
    return committed


def test_the_disk_running_full_at_any_point_of_a_save_loses_nothing(small_disk: Path, tmp_path: Path, tally: Any) -> None:
    template = tmp_path / "template"
    with CheckpointManager(template, **OPTIONS) as writer:
        for step in range(3):
            writer.save(step, big_state(step))
    failures = committed_failures = 0
    for free_pages in range(0, 256):
        run = small_disk / f"run-{free_pages}"
        shutil.copytree(template, run)
        filler = _fill(small_disk, free_pages * PAGE)
        manager = CheckpointManager(run, **OPTIONS)
        try:
            manager.save(3, big_state(3))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, repr(exc)
            failures += 1
            tally["disk-full points"] += 1
            committed = _check_after_failure(run, exc)
            committed_failures += committed
            filler.unlink()  # space comes back; the same manager goes on
            following = 4 if committed else 3
            manager.save(following, big_state(following))
            with CheckpointManager(run, **OPTIONS) as cleaner:  # a new writer removes what is left
                cleaner.save(following + 1, big_state(following + 1))
            assert _leftovers(run) == [] and verify_run(str(run)) == []
            shutil.rmtree(run)
            continue
        filler.unlink()
        shutil.rmtree(run)
        break
    assert failures > 10, "the disk should run out at many points of the save"
    assert committed_failures > 0, "and also after the commit, in the re-base"


def test_a_full_disk_never_damages_the_previous_single_file(small_disk: Path, tally: Any) -> None:
    path = small_disk / "model.ink"
    ink.save(big_state(0), path)
    for free_pages in range(0, 40, 3):
        filler = _fill(small_disk, free_pages * PAGE)
        try:
            ink.save(big_state(1), path)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            assert any(f"saving {path} failed" in note for note in exc.__notes__)
            tally["disk-full points"] += 1
            assert sorted(os.listdir(small_disk)) == ["filler", "model.ink"], "the temporary was removed"
            assert_same(ink.load(path), big_state(0))
        else:
            assert_same(ink.load(path), big_state(1))
            ink.save(big_state(0), path)
        finally:
            filler.unlink()


class _FsyncFails:
    """``os.fsync`` that fails its ``fail_at``-th call with ``code``."""

    def __init__(self, fail_at: int, code: int) -> None:
        self.calls, self.fail_at, self.code, self.real = 0, fail_at, code, os.fsync
        self.failed_on_directory = False

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            self.failed_on_directory = stat.S_ISDIR(os.fstat(fd).st_mode)
            raise OSError(self.code, f"injected {errno.errorcode[self.code]} in fsync")
        self.real(fd)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_a_failing_fsync_at_any_point_of_a_save_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, tally: Any
) -> None:
    template = tmp_path / "template"
    with CheckpointManager(template, **OPTIONS) as writer:
        for step in range(3):
            writer.save(step, big_state(step))
    for fail_at in range(1, 100):
        run = tmp_path / f"run-{fail_at}"
        shutil.copytree(template, run)
        fsync = _FsyncFails(fail_at, code)
        manager = CheckpointManager(run, **OPTIONS)
        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", fsync)
            try:
                manager.save(3, big_state(3))
            except OSError as exc:
                assert exc.errno == code and "injected" in str(exc)
                error = exc
            else:
                if fsync.calls < fail_at:
                    break
                # Some filesystems refuse to fsync a directory: that alone does not fail a save.
                assert fsync.failed_on_directory
                tally["fsync fault points"] += 1
                continue
        tally["fsync fault points"] += 1
        committed = _check_after_failure(run, error)
        manager.save(4 if committed else 3, big_state(4 if committed else 3))
    else:
        raise AssertionError("the save never got through")
    assert fail_at > 4


class _BudgetFile(io.RawIOBase):
    """A write-only file that takes ``budget`` bytes in all, then fails with ENOSPC (like a disk)."""

    def __init__(self, real: Any, budget: list[int]) -> None:
        self.real, self.budget = real, budget

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.budget[0]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.budget[0] -= size
        return self.real.write(data)

    def fileno(self) -> int:
        return self.real.fileno()

    def flush(self) -> None:
        self.real.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes first
            self.real.close()


@pytest.mark.parametrize("budget_bytes", [0, 100, 5_000, 40_000, 66_000, 70_000, 140_000])
def test_enospc_injected_at_the_storage_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_bytes: int) -> None:
    """The same guarantees without a mount: writes of the run's files fail past a byte budget."""
    run = tmp_path / "run"
    with CheckpointManager(run, **OPTIONS) as writer:
        for step in range(3):
            writer.save(step, big_state(step))
    budget = [budget_bytes]
    real_fdopen = os.fdopen
    monkeypatch.setattr(storage_module.os, "fdopen", lambda fd, mode: _BudgetFile(real_fdopen(fd, mode), budget))
    manager = CheckpointManager(run, **OPTIONS)
    try:
        manager.save(3, big_state(3))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
        monkeypatch.undo()
        _check_after_failure(run, exc)
    else:
        monkeypatch.undo()
        assert CheckpointManager(run).steps() == [2, 3]
