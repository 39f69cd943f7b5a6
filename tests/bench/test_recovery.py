"""The failure-recovery runner's accounting, on a tiny workload."""

from __future__ import annotations

import pytest

from inshrinkerator.bench.aggregate import aggregate_rows, run_metrics
from inshrinkerator.bench.recovery import failure_steps, run_reference, run_with_failures


def test_lossless_recovery_reproduces_the_uninterrupted_run(tiny: str, tmp_path) -> None:
    reference = run_reference(tiny, seed=0, quick=True)
    run = run_with_failures(tiny, 0, True, "lossless", tmp_path / "run")
    assert run.evaluation.value == reference.evaluation.value  # exact restores: same run
    metrics = run_metrics(run.to_dict(), reference.to_dict())
    assert metrics["deg_pct"] == 0.0

    # 22 steps, a checkpoint every 2: 11 saves, never repeated; 10 crashes, each resumed
    # from the newest checkpoint at or before it.
    assert [c.step for c in run.checkpoints] == list(range(2, 23, 2))
    assert len(run.restores) == 10
    for restore, failure in zip(run.restores, failure_steps(22, 10)):
        assert restore.failure_step == failure
        assert restore.restored_step == failure - failure % 2
        assert restore.seconds > 0 and restore.torch_load_seconds > 0

    on_disk = sum(p.stat().st_size for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert run.stored_bytes_on_disk == on_disk
    raw = sum(c.raw_bytes for c in run.checkpoints)
    assert metrics["cr_full"] == pytest.approx(raw / on_disk)
    classes = run.class_bytes
    assert classes.containers == len(run.checkpoints)
    assert metrics["cr_weights"] == pytest.approx(classes.raw["weights"] / classes.stored["weights"])
    # raw bytes counted from the headers agree with the bytes handed to save
    assert sum(classes.raw.values()) == raw
    assert metrics["ovh_pct"] == pytest.approx(100 * run.blocked_seconds / run.train_seconds)


def test_rows_spread_over_seeds(tiny: str, tmp_path) -> None:
    references, runs = [], []
    for seed in (0, 1):
        references.append(run_reference(tiny, seed, True).to_dict())
        record = run_with_failures(tiny, seed, True, "lossless", tmp_path / str(seed)).to_dict()
        runs.append(record)
    rows = aggregate_rows(references, runs)
    (row,) = rows
    assert row["seeds"] == 2 and row["policy"] == "lossless"
    assert row["deg_pct"]["mean"] == 0.0 and row["deg_pct"]["std"] == 0.0
    per_seed = [run_metrics(r, ref)["cr_full"] for r, ref in zip(runs, references)]
    assert row["cr_full"]["min"] == min(per_seed) and row["cr_full"]["max"] == max(per_seed)
    assert len(row["per_checkpoint_ratio"]) == 11


def test_every_simulated_process_gets_a_policy_without_memory(tiny: str, tmp_path) -> None:
    """A crash loses the policy's memory too: each process starts from the options alone."""
    from inshrinkerator.bench.recovery import fresh_policy
    from inshrinkerator.policies import DynaQuant

    given = DynaQuant(tolerance=0.004)
    used: list = []
    run = run_with_failures(tiny, 0, True, given, tmp_path / "run", on_new_policy=used.append)
    assert len(used) == 1 + len(run.restores)  # the first process and one per crash
    assert all(policy is not given and policy == given for policy in used)  # same options
    assert len({id(policy) for policy in used}) == len(used)
    assert given.search_log == []  # the caller's object was never used
    assert all(policy.search_log for policy in used[:-1])  # each process saved and searched
    fresh = fresh_policy(used[0])
    assert fresh == given and fresh.search_log == []
    assert fresh_policy("lossless") == "lossless"
