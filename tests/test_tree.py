"""tree: exact flatten/unflatten round trips, shared tensors, refusals that name the key path."""

from __future__ import annotations

import enum
import json
import math
import struct
import warnings
from collections import Counter, OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from inshrinkerator.errors import FormatError, UnsupportedStateError
from inshrinkerator.tree import MAX_DEPTH, flatten, format_key_path, tensor_paths, unflatten

from .helpers import ALL_DTYPES, make_tensor

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def through_json(state: Any) -> Any:
    """flatten -> JSON text (as the writer stores it) -> unflatten."""
    flat = flatten(state)
    text = json.dumps(flat.skeleton, separators=(",", ":"), allow_nan=False)
    return unflatten(json.loads(text), [leaf.tensor for leaf in flat.tensors])


def float_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def tensor_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_exact(a: Any, b: Any, path: str = "", pairs: dict[int, int] | None = None) -> None:
    """Equal types all the way down, float bits (NaN payloads too), key order, tensor bits.

    ``pairs`` maps id(original tensor) -> id(restored tensor) and must stay a function.
    """
    pairs = {} if pairs is None else pairs
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(tensor_bits(a), tensor_bits(b)), f"{path}: tensor bits differ"
        assert pairs.setdefault(id(a), id(b)) == id(b), f"{path}: one tensor came back as two"
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_exact(ka, kb, f"{path}/<key>", pairs)
            assert_exact(va, vb, f"{path}/{ka}", pairs)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exact(x, y, f"{path}/{i}", pairs)
    elif isinstance(a, float):
        assert float_bits(a) == float_bits(b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- strategies

_POOL = [make_tensor(dtype, shape, seed=i) for i, (dtype, shape) in enumerate(
    [(d, s) for d in ALL_DTYPES for s in [(), (0,), (3,), (2, 3)]]
)]
_BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)
# different views of one storage: each must come back with its own values
_POOL += [_BASE, _BASE.t(), _BASE[1], _BASE[:, ::2], _BASE.view(torch.int32), _BASE[1:3]]

tensors = st.sampled_from(_POOL)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [-0.0, 0.0, float("nan"), -float("nan"), 5e-324, -5e-324, 1.7976931348623157e308,
     struct.unpack("<d", bytes.fromhex("0100000000f87f7f"))[0]]  # a NaN with a payload
)
plain = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**300), max_value=2**300)
    | floats | st.text() | st.binary(max_size=20)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool])
    | st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size)
)
keys = st.text(max_size=8) | st.integers() | st.booleans() | st.none() | st.floats(allow_nan=False)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(keys, children, max_size=4).map(lambda d: OrderedDict(reversed(list(d.items()))))
    )


states = st.recursive(plain | tensors, _containers, max_leaves=25)


@PROPERTY
@given(states)
def test_any_state_round_trips_exactly(state: Any) -> None:
    try:
        back = through_json(state)
    except UnsupportedStateError as exc:  # e.g. tensors under keys 1 and "1" of one dict
        assert "rename one" in str(exc)
        assume(False)
    assert_exact(state, back)


@PROPERTY
@given(st.lists(tensors, min_size=1, max_size=8))
def test_shared_tensors_stay_shared_and_views_keep_their_values(chosen: list[torch.Tensor]) -> None:
    back = through_json({"xs": chosen, "again": tuple(chosen)})
    for original, restored, again in zip(chosen, back["xs"], back["again"]):
        assert restored is again
        assert torch.equal(original, restored)
    for i, a in enumerate(chosen):
        for j, b in enumerate(chosen):
            same_view = a is b or (a.numel() and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                                   and a.stride() == b.stride() and a.dtype == b.dtype)
            assert (back["xs"][i] is back["xs"][j]) == bool(same_view)


def test_tied_weights_are_stored_once() -> None:
    embedding = torch.randn(10, 4)
    state = {"embed": embedding, "head": embedding, "head_view": embedding.view(10, 4), "row": embedding[0]}
    flat = flatten(state)
    assert len(flat.tensors) == 2  # embedding (all three names) and the row view
    assert [(leaf.path, leaf.aliases) for leaf in flat.tensors] == [
        (("embed",), (("head",), ("head_view",))), (("row",), ()),
    ]
    back = unflatten(flat.skeleton, [leaf.tensor for leaf in flat.tensors])
    assert back["embed"] is back["head"] is back["head_view"]
    assert torch.equal(back["row"], embedding[0])


def test_conj_and_neg_views_are_not_mistaken_for_their_base() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    back = through_json({"z": z, "conj": z.conj(), "neg": z.conj().imag})
    assert torch.equal(back["conj"], z.conj().resolve_conj())
    assert torch.equal(back["neg"], z.conj().imag.resolve_neg())
    assert back["conj"] is not back["z"]


def test_key_types_order_and_container_types() -> None:
    state = OrderedDict([("b", 1), (2, [()]), (None, {}), (True, (1, [2])), (2.5, OrderedDict()), (-0.0, "z")])
    back = through_json(state)
    assert_exact(state, back)
    assert [type(k) for k in back] == [str, int, type(None), bool, float, float]
    assert math.copysign(1.0, list(back)[-1]) < 0


@pytest.mark.parametrize(
    "key",
    ["", "\x00", "a/b", "\u202e\u0301", "🚀", "\U0010ffff", "e\u0301", "\ufeff", "\\u0041", '"}]'],
    ids=repr,
)
def test_odd_unicode_keys_round_trip_exactly(key: str) -> None:
    state = {key: {key: key}}
    back = through_json(state)
    assert_exact(state, back)
    assert [len(k) for k in back] == [len(key)]


@pytest.mark.parametrize("text", ["\ud800", "\udfff", "ok\ud83d\ude00", "\udc80abc"], ids=repr)
def test_surrogates_are_refused_with_the_key_path(text: str) -> None:
    with pytest.raises(UnsupportedStateError, match="config/name"):
        flatten({"config": {"name": text}})
    with pytest.raises(UnsupportedStateError, match="surrogate"):
        flatten({"config": {text: 1}})


def test_surrogates_in_a_skeleton_are_a_format_error() -> None:
    with pytest.raises(FormatError, match="surrogate"):
        unflatten(json.loads('{"s": "\\ud800"}'), [])
    with pytest.raises(FormatError, match="surrogate"):
        unflatten(json.loads('{"d": [["\\udfff", null]]}'), [])


Point = namedtuple("Point", "x y")


class Color(enum.IntEnum):
    RED = 1


class MyDict(dict):
    pass


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CSR support is in beta"
        return torch.zeros(2, 2).to_sparse_csr()


@pytest.mark.parametrize(
    "leaf",
    [
        lambda x: x, object(), {1, 2}, frozenset(), 1 + 2j, bytearray(b"x"), Color.RED,
        np.float64(1.0), np.int64(3), np.zeros(2), MyDict(a=1), defaultdict(list), Counter("ab"),
        Point(1, 2), torch.device("cpu"), range(3), ...,
        torch.zeros(3).to_sparse(), _sparse_csr(), torch.empty(3, device="meta"),
    ],
    ids=lambda leaf: type(leaf).__name__ + (f"[{leaf.layout}/{leaf.device}]" if isinstance(leaf, torch.Tensor) else ""),
)
def test_unsupported_leaves_name_their_key_path(leaf: Any) -> None:
    state = {"model": {"layers": [0, 1, {"fn": leaf}]}}
    with pytest.raises(UnsupportedStateError, match="model/layers/2/fn"):
        flatten(state)
    with pytest.raises(TypeError):  # also an ordinary TypeError
        flatten(state)


@pytest.mark.parametrize("key", [(1, 2), b"k", Color.RED, np.int64(1), frozenset()], ids=repr)
def test_unsupported_keys_are_refused(key: Any) -> None:
    with pytest.raises(UnsupportedStateError, match="optimizer/state"):
        flatten({"optimizer": {"state": {key: 1}}})


def test_self_containing_state_is_refused() -> None:
    loop: list = [1]
    loop.append({"again": loop})
    with pytest.raises(UnsupportedStateError, match="contains itself"):
        flatten({"a": loop})


def test_nesting_limit_is_a_clean_refusal_both_ways() -> None:
    state: Any = 0
    for _ in range(MAX_DEPTH):  # MAX_DEPTH nested containers are fine
        state = [state]
    assert_exact(state, through_json(state))
    with pytest.raises(UnsupportedStateError, match="nested deeper"):
        flatten([state])
    deep_skeleton: Any = {"i": 0}
    for _ in range(50_000):
        deep_skeleton = {"l": [deep_skeleton]}
    with pytest.raises(FormatError, match="nested deeper"):
        unflatten(deep_skeleton, [])
    with pytest.raises(FormatError, match="nested deeper"):
        tensor_paths(deep_skeleton)


def test_big_ints_and_float_bits_are_exact() -> None:
    values = [2**63 - 1, -(2**63), 2**64, -(2**64) - 1, 10**5000, -(7**9000)]
    assert through_json(values) == values
    nan = struct.unpack("<d", bytes.fromhex("0100000000f87fff"))[0]
    assert float_bits(through_json([nan])[0]) == float_bits(nan)


def test_tensor_paths_name_the_first_occurrence() -> None:
    shared = torch.ones(2)
    flat = flatten({"opt": {"state": {0: {"m": shared}}}, "w": [shared, torch.zeros(1)]})
    assert {i: format_key_path(p) for i, p in tensor_paths(flat.skeleton).items()} == {
        0: "opt/state/0/m", 1: "w/1",
    }
    assert [format_key_path(leaf.path) for leaf in flat.tensors] == ["opt/state/0/m", "w/1"]


def test_requires_grad_parameters_are_stored_detached() -> None:
    layer = torch.nn.Linear(2, 2)
    back = through_json({"w": layer.weight})
    assert not back["w"].requires_grad and torch.equal(back["w"], layer.weight.detach())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(["t", "i", "ix", "f", "fb", "s", "y", "dt", "sz", "l", "tu", "d", "od", "b", "n", "x"]), children, max_size=2),
    max_leaves=12,
)


@PROPERTY
@given(json_values)
def test_malformed_skeletons_raise_format_error_only(skeleton: Any) -> None:
    for decode in (lambda s: unflatten(s, [torch.zeros(1)]), tensor_paths):
        try:
            decode(skeleton)
        except FormatError:
            pass


@pytest.mark.parametrize(
    "node",
    [
        {"dt": "_dynamo"}, {"dt": "Tensor"}, {"f": 1e999}, {"fb": "zz"}, {"fb": "7ff8"}, {"ix": "0xg"},
        {"i": True}, {"i": 1.5}, {"y": "###"}, {"sz": [-1]}, {"sz": [2**64]}, {"t": -1}, {"t": 1},
        {"t": True}, {"d": [["a", 1], ["a", 2]]}, {"d": [[["list-key"], 1]]}, {"l": {}}, {"x": 1},
        {"i": 1, "f": 2.0}, [], "str", 3, {"d": [["a"]]}, {"od": [[{"b": 1}, 1]]},
    ],
    ids=repr,
)
def test_each_kind_of_bad_node_is_a_format_error(node: Any) -> None:
    import sys

    was_loaded = "torch._dynamo" in sys.modules
    with pytest.raises(FormatError):
        unflatten({"d": [["k", node]]}, [torch.zeros(1)])
    assert ("torch._dynamo" in sys.modules) == was_loaded  # names from a file import nothing


def test_tensor_names_that_would_collide_are_refused() -> None:
    for state in ({1: torch.zeros(1), "1": torch.ones(1)}, {"a/b": torch.zeros(2), "a": {"b": torch.ones(2)}},
                  {None: torch.zeros(1), "None": torch.ones(1)}):
        with pytest.raises(UnsupportedStateError, match="rename one"):
            flatten(state)
    shared = torch.zeros(2)  # one tensor under two colliding names is fine: it is stored once
    assert len(flatten({1: shared, "1": shared, "x": {1: 0, "1": 1}}).tensors) == 1
