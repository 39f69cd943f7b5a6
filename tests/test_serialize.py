"""Partial reads of a container: what a chain restore decodes of a base step."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from inshrinkerator.container import ContainerReader
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError
from inshrinkerator.policies import resolve_policy
from inshrinkerator.serialize import (
    read_state,
    read_tensors,
    reference_map,
    referenced_keys,
    tensor_keys,
    write_state,
)

from .helpers import assert_same


def _state(shift: float) -> dict[str, Any]:
    weight = torch.linspace(-1, 1, 512) + shift
    return {
        "model": {"weight": weight, "bias": torch.full((8,), shift)},
        "optimizer": {"exp_avg": torch.linspace(0, 1, 256) * shift, "step": torch.tensor(3)},
        "name": "run",
    }


def _written(state: Any, references: Any = None) -> bytes:
    out = io.BytesIO()
    write_state(out, state, resolve_policy("lossless"), references=references)
    return out.getvalue()


def _reader(data: bytes) -> ContainerReader:
    return ContainerReader(io.BytesIO(data), "mem.ink")


def test_tensor_keys_follow_the_records() -> None:
    with _reader(_written(_state(0.0))) as reader:
        keys = tensor_keys(reader)
    assert sorted(keys) == sorted(reference_map(_state(0.0)))
    assert len(keys) == len(set(keys))


def test_a_subset_decodes_alone_and_matches_the_whole_read() -> None:
    base = _state(0.0)
    delta = _written(_state(0.5), reference_map(base))
    with _reader(delta) as reader:
        stored_against = referenced_keys(reader)
        assert stored_against and stored_against < set(tensor_keys(reader))
        part = read_tensors(reader, stored_against, reference_map(base))
        whole = reference_map(read_state(reader, reference_map(base)))
    assert set(part) == stored_against
    for key, tensor in part.items():
        assert_same(tensor, whole[key])
    # Keys the file does not hold are skipped; None reads everything.
    with _reader(delta) as reader:
        assert read_tensors(reader, {"no/such/key"}, reference_map(base)) == {}
        assert set(read_tensors(reader, None, reference_map(base))) == set(whole)
        assert referenced_keys(reader, among={"model/bias"}) <= {"model/bias"}


def test_a_subset_still_needs_its_references() -> None:
    base = _state(0.0)
    delta = _written(_state(0.5), reference_map(base))
    with _reader(delta) as reader:
        wanted = referenced_keys(reader)
        with pytest.raises(BrokenChainError, match="not given"):
            read_tensors(reader, wanted, {})


def test_damage_outside_the_subset_is_still_caught() -> None:
    data = bytearray(_written(_state(0.0)))
    with _reader(bytes(data)) as reader:
        keys = tensor_keys(reader)
        records = reader.header.tensors
        start = reader.data_start
    skipped = next(i for i, record in enumerate(records) if record.stored_bytes and keys[i] != keys[0])
    data[start + records[skipped].sections[0].offset] ^= 0x01
    with _reader(bytes(data)) as reader:
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            read_tensors(reader, {keys[0]})


def test_a_full_checkpoint_references_nothing() -> None:
    with _reader(_written(_state(0.0))) as reader:
        assert referenced_keys(reader) == set()
        assert torch.equal(read_tensors(reader, {"model/weight"})["model/weight"], _state(0.0)["model"]["weight"])


def test_write_state_plans_with_the_state_it_flattened() -> None:
    from inshrinkerator.policies import Lossless

    class Recording(Lossless):
        seen: list = []

        def plan_state(self, state, leaves, references):
            Recording.seen.append((state, [leaf.path for leaf in leaves]))
            return super().plan_state(state, leaves, references)

    state = _state(0.5)
    write_state(io.BytesIO(), state, Recording())
    (seen_state, paths), = Recording.seen
    assert seen_state is state
    assert ("model", "weight") in paths and ("optimizer", "exp_avg") in paths


# ------------------------------------------------------------------ context records


def _moments(shift: float) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(int(shift * 10))
    first = torch.randn(64, 48, generator=generator) * 1e-3
    first = torch.where(torch.rand(64, 48, generator=generator) < 0.1, first, 0.0)
    second = torch.exp2(torch.randn(64, 48, generator=generator) - 20 + shift)
    return {"model": {"w": torch.randn(64, 48, generator=generator)}, "optimizer": {"exp_avg": first, "exp_avg_sq": second}}


class _MaskedSecondMoment:
    """A policy: the first moment exact, the second stored with the first moment's zeros
    (``context``: the key it names; ``delta``: against the reference when one is given)."""

    name = "masked-test"

    def __init__(self, context: str = "optimizer/exp_avg") -> None:
        self.context = context

    def plan_state(self, state, leaves, references):
        from inshrinkerator.codecs import DynaQuantMaskedCodec, DynaQuantMaskedDeltaCodec
        from inshrinkerator.policies import Lossless
        from inshrinkerator.tree import format_key_path

        codecs = Lossless().plan(leaves, references)
        for index, leaf in enumerate(leaves):
            if format_key_path(leaf.path) == "optimizer/exp_avg_sq":
                masked = DynaQuantMaskedDeltaCodec if references[index] is not None else DynaQuantMaskedCodec
                codecs[index] = masked(bins=8, domain="log").against(self.context)
        return codecs


def _written_with(state: Any, policy: Any, references: Any = None) -> bytes:
    out = io.BytesIO()
    write_state(out, state, policy, references=references)
    return out.getvalue()


def test_a_tensor_stored_with_a_context_decodes_after_it() -> None:
    base = _moments(0.0)
    full = _written_with(base, _MaskedSecondMoment())
    with _reader(full) as reader:
        keys = tensor_keys(reader)
        records = reader.header.tensors
        second = keys.index("optimizer/exp_avg_sq")
        assert records[second].context == keys.index("optimizer/exp_avg") < second
        assert all(record.context is None for i, record in enumerate(records) if i != second)
        restored = read_state(reader)
    assert torch.equal(restored["optimizer"]["exp_avg_sq"] == 0, base["optimizer"]["exp_avg"] == 0)
    assert torch.equal(restored["optimizer"]["exp_avg"], base["optimizer"]["exp_avg"])
    # A delta: reading only the second moment decodes its context too, so the base step
    # must provide the references of both (the lossless first moment is a delta too).
    delta = _written_with(_moments(0.5), _MaskedSecondMoment(), reference_map(restored))
    with _reader(delta) as reader:
        assert referenced_keys(reader, among={"optimizer/exp_avg_sq"}) == {"optimizer/exp_avg_sq", "optimizer/exp_avg"}
        assert "optimizer/exp_avg" not in referenced_keys(reader, among={"model/w"})
        part = read_tensors(reader, {"optimizer/exp_avg_sq"}, reference_map(restored))
        whole = reference_map(read_state(reader, reference_map(restored)))
    assert set(part) == {"optimizer/exp_avg_sq", "optimizer/exp_avg"}
    for key, tensor in part.items():
        assert_same(tensor, whole[key])
    assert torch.equal(whole["optimizer/exp_avg_sq"] == 0, whole["optimizer/exp_avg"] == 0)


@pytest.mark.parametrize("context", ["optimizer/missing", "optimizer/exp_avg_sq"])
def test_a_context_must_be_another_tensor_of_the_state(context: str) -> None:
    with pytest.raises(ValueError, match="context"):
        write_state(io.BytesIO(), _moments(0.0), _MaskedSecondMoment(context))


class _GroupedFirstMoment:
    """A policy: the second moment quantized, the first coded per octave of it (a context
    stored after its record)."""

    name = "grouped-test"

    def plan_state(self, state, leaves, references):
        from inshrinkerator.codecs import DynaQuantCodec, DynaQuantGroupedCodec
        from inshrinkerator.policies import Lossless
        from inshrinkerator.tree import format_key_path

        codecs = Lossless().plan(leaves, references)
        for index, leaf in enumerate(leaves):
            key = format_key_path(leaf.path)
            if key == "optimizer/exp_avg":
                codecs[index] = DynaQuantGroupedCodec(bins=8).against("optimizer/exp_avg_sq")
            elif key == "optimizer/exp_avg_sq":
                codecs[index] = DynaQuantCodec(bins=8, domain="log")
        return codecs


def test_a_context_stored_after_its_record_is_encoded_first() -> None:
    from inshrinkerator.codecs import DynaQuantCodec

    generator = torch.Generator().manual_seed(3)
    second = torch.exp2(2 * torch.randn(256, 128, generator=generator) - 20)
    first = torch.randn(256, 128, generator=generator) * second.sqrt()
    state = {"model": {"w": torch.randn(8, 8, generator=generator)}, "optimizer": {"exp_avg": first, "exp_avg_sq": second}}
    out = io.BytesIO()
    written = write_state(out, state, _GroupedFirstMoment(), keep_reconstruction=True)
    with _reader(out.getvalue()) as reader:
        keys = tensor_keys(reader)
        first, second = keys.index("optimizer/exp_avg"), keys.index("optimizer/exp_avg_sq")
        assert reader.header.tensors[first].context == second > first
        restored = reference_map(read_state(reader))
        part = read_tensors(reader, {"optimizer/exp_avg"})
    assert set(part) == {"optimizer/exp_avg", "optimizer/exp_avg_sq"}
    for key, tensor in written.reconstruction.items():
        assert_same(restored[key], tensor)
        if key in part:
            assert_same(part[key], tensor)
    # The same levels and values as the plain codec, in fewer bytes.
    plain = DynaQuantCodec(bins=8).encode(state["optimizer"]["exp_avg"])
    assert_same(restored["optimizer/exp_avg"], plain.reconstruction)
    assert reader.header.tensors[first].stored_bytes < 0.8 * sum(len(stream) for stream in plain.streams)


def test_records_with_a_bad_context_are_refused() -> None:
    import json

    from inshrinkerator.container.format import FORMAT_VERSION
    from inshrinkerator.errors import FormatError

    from .container.test_attack_files import SCRIPT
    from .container.test_reader import data_region, header_doc

    data = _written_with(_moments(0.0), _MaskedSecondMoment())
    with _reader(data) as reader:
        second = tensor_keys(reader).index("optimizer/exp_avg_sq")
    doc, body = header_doc(data), data_region(data)
    for bad, match in ((second, "its own context"), (second + 5, "no record of the file"), (-1, "record index"),
                       (True, "record index"), ("0", "record index"), (None, "needs a context")):
        forged = json.loads(json.dumps(doc))
        forged["tensors"][second]["context"] = bad
        with pytest.raises(FormatError, match=match):
            with _reader(SCRIPT.forge_v2(forged, body, version=FORMAT_VERSION)) as reader:
                read_state(reader)
    # Contexts that run in a circle: the first moment made the second's context in turn.
    forged = json.loads(json.dumps(doc))
    first = forged["tensors"][second]["context"]
    forged["tensors"][first]["context"] = second
    with pytest.raises(FormatError, match="circle"):
        with _reader(SCRIPT.forge_v2(forged, body, version=FORMAT_VERSION)) as reader:
            read_state(reader)
    # A context moved to a record whose codec takes none is refused too.
    forged = json.loads(json.dumps(doc))
    del forged["tensors"][second]["context"]
    forged["tensors"][second - 1]["context"] = 0
    with pytest.raises(FormatError, match="(does not take|needs) a context"):
        with _reader(SCRIPT.forge_v2(forged, body, version=FORMAT_VERSION)) as reader:
            read_state(reader)


class _ByKey:
    """A policy: lossless but for the tensors whose key ``planned`` names (key -> a function
    of the tensor's reference that gives its codec, or None to keep it lossless)."""

    def __init__(self, name: str, planned: dict[str, Any]) -> None:
        self.name = name
        self.planned = planned

    def plan_state(self, state, leaves, references):
        from inshrinkerator.policies import Lossless
        from inshrinkerator.tree import format_key_path

        codecs = Lossless().plan(leaves, references)
        for index, leaf in enumerate(leaves):
            make = self.planned.get(format_key_path(leaf.path))
            codec = make(references[index]) if make is not None else None
            if codec is not None:
                codecs[index] = codec
        return codecs


def _chained_contexts() -> _ByKey:
    # The weight stored as its change grouped by its first moment's sign, that first moment
    # per octave of the second moment: a chain of two contexts, each stored after the
    # record that needs it.
    from inshrinkerator.codecs import (
        DynaQuantCodec,
        DynaQuantGroupedCodec,
        SignGroupedResidualCodec,
    )

    return _ByKey("chained-test", {
        "model/w": lambda reference: None if reference is None else SignGroupedResidualCodec(DynaQuantCodec(bins=10)).against("optimizer/exp_avg"),
        "optimizer/exp_avg": lambda _: DynaQuantGroupedCodec(bins=8).against("optimizer/exp_avg_sq"),
        "optimizer/exp_avg_sq": lambda _: DynaQuantCodec(bins=8, domain="log"),
    })


def _adam_like(seed: int, weight: torch.Tensor) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    second = torch.exp2(2 * torch.randn(weight.shape, generator=generator) - 20)
    first = torch.randn(weight.shape, generator=generator) * second.sqrt()
    moved = weight - 1e-3 * first.sign() * torch.rand(weight.shape, generator=generator)
    return {"model": {"w": moved}, "optimizer": {"exp_avg": first, "exp_avg_sq": second}}


def test_contexts_may_chain_and_decode_in_order() -> None:
    start = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    base = _adam_like(1, start)
    out = io.BytesIO()
    first = write_state(out, base, _chained_contexts(), keep_reconstruction=True)
    state = _adam_like(2, first.reconstruction["model/w"])
    out = io.BytesIO()
    written = write_state(out, state, _chained_contexts(), references=first.reconstruction, keep_reconstruction=True)
    with _reader(out.getvalue()) as reader:
        keys = tensor_keys(reader)
        weight, moment, second = (keys.index(k) for k in ("model/w", "optimizer/exp_avg", "optimizer/exp_avg_sq"))
        records = reader.header.tensors
        assert (records[weight].context, records[moment].context, records[second].context) == (moment, second, None)
        assert weight < moment < second  # both contexts come after the records that need them
        restored = reference_map(read_state(reader, first.reconstruction))
        # Reading the weight alone decodes its whole chain of contexts.
        part = read_tensors(reader, {"model/w"}, first.reconstruction)
        assert referenced_keys(reader, among={"model/w"}) == {"model/w"}
    assert set(part) == {"model/w", "optimizer/exp_avg", "optimizer/exp_avg_sq"}
    for key, tensor in written.reconstruction.items():
        assert_same(restored[key], tensor)
        if key in part:
            assert_same(part[key], tensor)


def test_contexts_that_run_in_a_circle_are_refused_before_anything_is_written() -> None:
    from inshrinkerator.codecs import DynaQuantGroupedCodec, DynaQuantMaskedCodec

    circle = _ByKey("circle-test", {
        "optimizer/exp_avg": lambda _: DynaQuantGroupedCodec(bins=8).against("optimizer/exp_avg_sq"),
        "optimizer/exp_avg_sq": lambda _: DynaQuantMaskedCodec(bins=8, domain="log").against("optimizer/exp_avg"),
    })
    out = io.BytesIO()
    with pytest.raises(ValueError, match="circle"):
        write_state(out, _adam_like(1, torch.zeros(40, 30)), circle)
    assert out.getvalue() == b""


def test_context_depths_count_the_chain_below_each_record() -> None:
    from inshrinkerator.container.format import context_depths

    assert context_depths([]) == []
    assert context_depths([None, 0, 1, None, 2, 3]) == [0, 1, 2, 0, 3, 1]
    assert context_depths([2, None, 1]) == [2, 0, 1]
    for contexts, problem in (([0], "own context"), ([None, 5], "no record"), ([1, 0], "circle"),
                              ([None, 2, 3, 1], "circle"), ([-1], "no record")):
        with pytest.raises(ValueError, match=problem):
            context_depths(contexts)
