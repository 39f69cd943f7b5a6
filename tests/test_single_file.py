"""ink.save / ink.load: exact round trips, deltas against a base, errors, atomic writes."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import ByteGroupingCodec

from .helpers import ALL_DTYPES, assert_same, make_tensor, training_state


def roundtrip(state, tmp_path: Path, **kwargs):
    path = tmp_path / "state.ink"
    info = ink.save(state, path, **kwargs)
    assert path.stat().st_size == info.stored_bytes
    return ink.load(path, base=kwargs.get("base")), info


def test_realistic_training_state_round_trips_exactly(tmp_path: Path) -> None:
    state = training_state(steps=4)
    back, info = roundtrip(state, tmp_path)
    assert_same(state, back)
    assert info.kind == "full" and info.policy == "lossless" and info.step is None
    assert info.raw_bytes == sum(
        t.numel() * t.element_size()
        for t in [*state["model"].values(), state["rng"]]
        + [v for s in state["optimizer"]["state"].values() for v in s.values()]
    )


def test_restored_state_resumes_training_identically(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.randn(32, 6), torch.randn(32, 3)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> float:
        loss = torch.nn.functional.mse_loss(m(data[0]), data[1])
        o.zero_grad()
        loss.backward()
        o.step()
        return loss.item()

    for _ in range(3):
        step(model, optimizer)
    ink.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.ink")
    restored_model = torch.nn.Linear(6, 3)
    restored_optimizer = torch.optim.AdamW(restored_model.parameters(), lr=0.5)
    state = ink.load(tmp_path / "c.ink")
    restored_model.load_state_dict(state["model"])
    restored_optimizer.load_state_dict(state["optimizer"])
    assert [step(model, optimizer) for _ in range(3)] == [
        step(restored_model, restored_optimizer) for _ in range(3)
    ]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (257, 33)], ids=str)
def test_every_dtype_and_shape(tmp_path: Path, dtype: torch.dtype, shape: tuple) -> None:
    state = {"x": make_tensor(dtype, shape), "y": [make_tensor(dtype, shape, seed=1)]}
    back, _ = roundtrip(state, tmp_path)
    assert_same(state, back)


def test_non_contiguous_views_and_shared_storage(tmp_path: Path) -> None:
    base = torch.randn(64, 32)
    state = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "tied_a": base,
        "tied_b": base,
        "row": base[5],
    }
    back, info = roundtrip(state, tmp_path)
    assert_same(state, back)
    assert back["tied_a"] is back["tied_b"]
    # the tied tensor is stored once; the transposed view and the row are views of their own
    assert info.raw_bytes == 4 * (2 * base.numel() + state["strided"].numel() + 32)


def test_plain_values_come_back_exactly(tmp_path: Path) -> None:
    state = OrderedDict(
        step=10**20, lr=3e-4, nan=float("nan"), inf=float("-inf"), zero=-0.0, flag=False,
        name="ü ∑ 🚀", none=None, raw=b"\x00\xff", dtype=torch.bfloat16, size=torch.Size([2, 3]),
        nested=({1: "int key", "1": "str key", None: 1}, {True: 2.5, False: "no"}, [[[]]], ()),
    )
    back, _ = roundtrip(state, tmp_path)
    assert_same(state, back)


def test_unsupported_value_names_its_key_path(tmp_path: Path) -> None:
    with pytest.raises(ink.UnsupportedStateError, match="optimizer/param_groups/0/fn"):
        ink.save({"optimizer": {"param_groups": [{"fn": lambda x: x}]}}, tmp_path / "x.ink")
    with pytest.raises(TypeError):  # also an ordinary TypeError
        ink.save({"s": {1, 2}}, tmp_path / "x.ink")
    assert not list(tmp_path.iterdir())


def test_missing_file_is_checkpoint_not_found(tmp_path: Path) -> None:
    with pytest.raises(ink.CheckpointNotFoundError, match="nothing.ink"):
        ink.load(tmp_path / "nothing.ink")
    with pytest.raises(FileNotFoundError):
        ink.load(tmp_path / "nothing.ink")
    with pytest.raises(ink.FormatError, match="is a directory"):
        ink.load(tmp_path)


def test_failed_save_keeps_the_earlier_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.ink"
    first = training_state(steps=1)
    ink.save(first, path)
    calls = 0
    original = ByteGroupingCodec.encode

    def failing_encode(self, tensor, reference=None):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("disk went away")
        return original(self, tensor, reference)

    monkeypatch.setattr(ByteGroupingCodec, "encode", failing_encode)
    with pytest.raises(OSError, match="disk went away"):
        ink.save(training_state(steps=2), path)
    assert_same(first, ink.load(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ink"]


def fine_tune(state: dict[str, torch.Tensor], steps: int = 5) -> dict[str, torch.Tensor]:
    tuned = {k: v.clone() for k, v in state.items()}
    for _ in range(steps):
        for value in tuned.values():
            if value.is_floating_point():
                value.add_(torch.randn_like(value) * 1e-4 * value.abs().mean())
    return tuned


def test_base_delta_is_smaller_and_needs_the_right_base(tmp_path: Path) -> None:
    torch.manual_seed(3)
    pretrained = {"w": torch.randn(256, 128) * 0.05, "b": torch.randn(128), "ids": torch.arange(100)}
    tuned = fine_tune(pretrained)
    tuned["new_head"] = torch.randn(128, 4)  # a key the base does not have: stored in full
    alone = ink.save(tuned, tmp_path / "alone.ink")
    delta = ink.save(tuned, tmp_path / "delta.ink", base=pretrained)
    assert delta.kind == "delta" and alone.kind == "full"
    assert delta.stored_bytes < alone.stored_bytes * 0.9
    assert_same(tuned, ink.load(tmp_path / "delta.ink", base=pretrained))

    with pytest.raises(ink.BrokenChainError, match="base"):
        ink.load(tmp_path / "delta.ink")
    wrong = dict(pretrained, w=pretrained["w"] + 1e-3)
    with pytest.raises(ink.BrokenChainError, match="checksum"):
        ink.load(tmp_path / "delta.ink", base=wrong)


def test_base_can_be_a_file(tmp_path: Path) -> None:
    pretrained = {"w": torch.randn(64, 64)}
    ink.save(pretrained, tmp_path / "base.ink")
    tuned = fine_tune(pretrained)
    ink.save(tuned, tmp_path / "tuned.ink", base=tmp_path / "base.ink")
    assert_same(tuned, ink.load(tmp_path / "tuned.ink", base=str(tmp_path / "base.ink")))


def test_fsspec_memory_url_round_trip() -> None:
    state = training_state(steps=1)
    info = ink.save(state, "memory://inshrink-tests/state.ink")
    assert info.stored_bytes > 0
    assert_same(state, ink.load("memory://inshrink-tests/state.ink"))
    with pytest.raises(ink.CheckpointNotFoundError):
        ink.load("memory://inshrink-tests/absent.ink")


def test_unknown_policy_is_a_clear_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        ink.save({"x": torch.ones(3)}, tmp_path / "x.ink", policy="nope")


def test_progress_callback_reaches_the_total(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    state = training_state(steps=1)
    ink.save(state, tmp_path / "p.ink", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    loaded: list[tuple[int, int]] = []
    ink.load(tmp_path / "p.ink", progress=lambda done, total: loaded.append((done, total)))
    assert loaded[-1][0] == loaded[-1][1] == seen[-1][1]


def test_public_errors_are_builtin_subclasses() -> None:
    assert issubclass(ink.FormatError, ValueError)
    assert issubclass(ink.CorruptCheckpointError, ink.FormatError)
    assert issubclass(ink.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(ink.UnsupportedStateError, TypeError)
    for error in (ink.FormatError, ink.BrokenChainError, ink.UnsupportedStateError):
        assert issubclass(error, ink.InkError)
