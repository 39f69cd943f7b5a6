"""Lossless reference rows restore bit for bit and leave the caller's state untouched."""

from __future__ import annotations

import copy

import pytest

from inshrinkerator.bench.lossless_rows import LOSSLESS_ROWS, LosslessTotals, measure_state
from tests.helpers import assert_same, training_state

# zipnn (a lossless reference row) triggers torch's own deprecation of torch.jit.script.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")



@pytest.mark.parametrize("row", LOSSLESS_ROWS, ids=lambda r: r.name)
def test_row_round_trips_and_counts(row) -> None:
    state = training_state()
    untouched = copy.deepcopy(state)
    totals = LosslessTotals(row.name)
    measure_state(row, state, totals)
    measure_state(row, state, totals)
    assert totals.exact
    assert_same(state, untouched)  # zipnn rewrites its input buffer: the row must copy first
    assert totals.raw_bytes > totals.weights_raw_bytes > 0
    assert totals.stored_bytes > 0 and totals.weights_stored_bytes > 0
    assert len(totals.per_checkpoint_ratio) == 2
    assert totals.pack_seconds > 0 and totals.unpack_seconds > 0


def test_zipnn_saves_on_fp32_and_reports_classes() -> None:
    zipnn_row = next(r for r in LOSSLESS_ROWS if r.name == "zipnn")
    totals = LosslessTotals("zipnn")
    measure_state(zipnn_row, training_state(), totals)
    assert totals.stored_bytes < totals.raw_bytes
    assert totals.class_stored["weights"] > 0 and totals.class_stored["second_moment"] > 0
