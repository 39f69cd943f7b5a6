"""Flatten a nested training state into key paths and back, exactly.

A state is what people checkpoint today: nested ``dict`` / ``OrderedDict`` /
``list`` / ``tuple`` holding tensors and plain values (``int``, ``float``,
``bool``, ``str``, ``None``; also ``bytes``, ``torch.dtype`` and ``torch.Size``).
:func:`flatten` turns it into a JSON-safe *skeleton* plus a list of tensor
leaves; :func:`unflatten` rebuilds the identical structure (container types,
key types and key order preserved).

Exactness rules:

* Plain values must be of exactly these types: subclasses (``IntEnum``,
  ``numpy.float64``, namedtuples, ``defaultdict``) are refused rather than
  silently turned into their base type.
* Floats come back bit for bit, including ``-0.0``, infinities and the sign and
  payload of NaNs (non-finite values and ``-0.0`` are stored as their 64-bit
  pattern). Integers of any size come back exactly.
* Strings holding surrogate code points (``"\\ud800"``; not valid Unicode text,
  e.g. from ``surrogateescape`` decoding) are refused: JSON would merge an
  adjacent surrogate pair into one character. Store such data as ``bytes``.
* Tensors that are the very same view of the same storage (same storage,
  offset, shape, stride, dtype) are stored once and come back as one tensor
  object, so tied weights stay tied. Other views of a shared storage are
  stored as separate tensors with their own values.

Skeleton nodes (one-key JSON objects unless noted)::

    null / true / false      None / bool
    {"i": 12} {"ix": "-0x1f"}  int (hex text when wider than 64 bits)
    {"f": 0.5} {"fb": "fff8000000000000"}  float (64-bit pattern when not finite or -0.0)
    {"s": "text"} {"y": "<base64>"}  str / bytes
    {"dt": "bfloat16"} {"sz": [2, 3]}  torch.dtype / torch.Size
    {"t": 0}                 the tensor at that index
    {"l": [...]} {"tu": [...]}  list / tuple
    {"d": [[key, value], ...]} {"od": [...]}  dict / OrderedDict; a key is a bare
                             string or one of the int / float / bool / None nodes ({"b": true},
                             {"n": null} for bool and None keys).
"""

from __future__ import annotations

import base64
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from .errors import FormatError, UnsupportedStateError

__all__ = [
    "KeyPath",
    "TensorLeaf",
    "FlatState",
    "MAX_DEPTH",
    "flatten",
    "unflatten",
    "tensor_paths",
    "format_key_path",
]

#: The keys (dicts) and indices (lists, tuples) leading to a value; keys other than str
#: and int appear as their ``str()``.
KeyPath = tuple[Union[str, int], ...]

# Real states are a handful of levels deep; the limit keeps both directions far
# from the interpreter's recursion limit, whatever a file claims.
MAX_DEPTH = 100

_DOUBLE = struct.Struct("<d")
_BITS = struct.Struct("<Q")
_INT64_BITS = 64
# Every dtype torch defines, by name; never ``getattr(torch, name)`` on a name from a
# file, which could import arbitrary lazily-loaded torch submodules.
_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


@dataclass(frozen=True)
class TensorLeaf:
    """One distinct tensor of a state, the first key path it was found at, and the later
    key paths that hold the same tensor (tied weights, e.g. a language model's embedding
    and output layer)."""

    path: KeyPath
    tensor: torch.Tensor
    aliases: tuple[KeyPath, ...] = ()


@dataclass
class FlatState:
    """A flattened state: a JSON-safe ``skeleton`` and the tensors it points at by index."""

    skeleton: Any
    tensors: list[TensorLeaf]


def format_key_path(path: KeyPath) -> str:
    """Render a key path, e.g. ``optimizer/state/0/exp_avg``.

    Within one flattened state the tensors' rendered paths are distinct (see :func:`flatten`),
    so they can name tensors, e.g. to pair them with a reference state's.
    """
    return "/".join(str(part) for part in path) if path else "<root>"


def _has_surrogates(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ----------------------------------------------------------------------------- encoding


def _encode_int(value: int) -> dict:
    # Python's JSON refuses integers of more than 4300 digits; hex text has no such limit.
    if value.bit_length() < _INT64_BITS:
        return {"i": value}
    return {"ix": hex(value)}


def _encode_float(value: float) -> dict:
    if math.isfinite(value) and not (value == 0.0 and math.copysign(1.0, value) < 0):
        return {"f": value}  # JSON's shortest repr round-trips every finite float exactly
    # JSON has no NaN/Inf, and -0.0 and NaN signs/payloads do not survive every encoder.
    (bits,) = _BITS.unpack(_DOUBLE.pack(value))
    return {"fb": f"{bits:016x}"}


def _refuse_str(path: KeyPath, what: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"{what} at {format_key_path(path)} holds surrogate code points, which are not valid "
        "Unicode text and cannot be stored exactly; store it as bytes (e.g. "
        "text.encode('utf-8', 'surrogateescape'))"
    )


def _encode_key(key: Any, path: KeyPath) -> Any:
    kind = type(key)
    if kind is str:
        if _has_surrogates(key):
            raise _refuse_str(path, f"dict key {key!r}")
        return key
    if kind is bool:
        return {"b": key}
    if kind is int:
        return _encode_int(key)
    if kind is float:
        return _encode_float(key)
    if key is None:
        return {"n": None}
    raise UnsupportedStateError(
        f"dict key {key!r} of type {kind.__module__}.{kind.__qualname__} at "
        f"{format_key_path(path)} is not supported; use str, int, float, bool or None keys"
    )


def _key_part(key: Any) -> Union[str, int]:
    return key if type(key) in (str, int) else str(key)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[TensorLeaf] = []
        self._seen: dict[tuple, int] = {}
        self._open: set[int] = set()  # ids of the containers on the current path

    def leaf_tensor(self, tensor: torch.Tensor, path: KeyPath) -> dict:
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise UnsupportedStateError(
                f"tensor at {format_key_path(path)} has layout {tensor.layout}; convert it "
                "with .to_dense() before saving"
            )
        if tensor.device.type == "meta":
            raise UnsupportedStateError(
                f"tensor at {format_key_path(path)} is on the meta device and holds no data; "
                "materialize it before saving"
            )
        if tensor.is_quantized or tensor.is_nested:
            raise UnsupportedStateError(
                f"tensor at {format_key_path(path)} is a quantized or nested tensor, which "
                "cannot be stored; dequantize or unbind it first"
            )
        if tensor.dtype not in _DTYPES_BY_NAME.values():
            raise UnsupportedStateError(f"tensor at {format_key_path(path)} has unknown dtype {tensor.dtype}")
        if tensor.numel():
            identity: tuple = (
                tensor.untyped_storage().data_ptr(),
                tensor.device,
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
                # conj() and neg views share everything above but hold other values.
                tensor.is_conj(),
                tensor.is_neg(),
            )
        else:
            identity = ("empty", id(tensor))  # empty tensors have no storage to compare
        index = self._seen.get(identity)
        if index is None:
            index = len(self.tensors)
            self.tensors.append(TensorLeaf(path, tensor.detach().resolve_conj().resolve_neg()))
            self._seen[identity] = index
        else:
            first = self.tensors[index]
            self.tensors[index] = TensorLeaf(first.path, first.tensor, first.aliases + (path,))
        return {"t": index}

    def visit(self, value: Any, path: KeyPath) -> Any:
        kind = type(value)
        if value is None or kind is bool:
            return value
        if kind is int:
            return _encode_int(value)
        if kind is float:
            return _encode_float(value)
        if kind is str:
            if _has_surrogates(value):
                raise _refuse_str(path, "string")
            return {"s": value}
        if kind is bytes:
            return {"y": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.Tensor):
            return self.leaf_tensor(value, path)
        if kind is torch.dtype:
            return {"dt": str(value).removeprefix("torch.")}
        if kind is torch.Size:
            return {"sz": list(value)}
        if kind in (dict, OrderedDict, list, tuple):
            return self.visit_container(value, path)
        raise UnsupportedStateError(
            f"value of type {kind.__module__}.{kind.__qualname__} at "
            f"{format_key_path(path)} cannot be stored; a state holds tensors, dict/OrderedDict/"
            "list/tuple and int/float/bool/str/bytes/None of exactly those types (convert it, "
            "e.g. float(x) for a numpy scalar or dict(d) for a dict subclass, or leave it out)"
        )

    def visit_container(self, value: Any, path: KeyPath) -> dict:
        if len(path) >= MAX_DEPTH:
            raise UnsupportedStateError(
                f"state is nested deeper than {MAX_DEPTH} levels at "
                f"{format_key_path(path[:6])}/...; flatten that part of the state"
            )
        if id(value) in self._open:
            raise UnsupportedStateError(
                f"container at {format_key_path(path)} contains itself; a state must be a tree"
            )
        self._open.add(id(value))
        try:
            kind = type(value)
            if kind in (dict, OrderedDict):
                items = []
                for key, item in value.items():
                    items.append([_encode_key(key, path), self.visit(item, path + (_key_part(key),))])
                return {"d" if kind is dict else "od": items}
            nodes = [self.visit(item, path + (i,)) for i, item in enumerate(value)]
            return {"l" if kind is list else "tu": nodes}
        finally:
            self._open.discard(id(value))


def flatten(state: Any) -> FlatState:
    """Split ``state`` into a JSON-safe skeleton and its distinct tensors.

    Raises:
        UnsupportedStateError: a leaf or key cannot be stored exactly, or two distinct tensors
            have key paths that render alike; the message names the key path.
    """
    flattener = _Flattener()
    skeleton = flattener.visit(state, ())
    named: dict[str, KeyPath] = {}
    for leaf in flattener.tensors:
        name = format_key_path(leaf.path)
        other = named.setdefault(name, leaf.path)
        if other is not leaf.path:
            raise UnsupportedStateError(
                f"two different tensors are both named {name!r} (key paths {other!r} and "
                f"{leaf.path!r}): keys like 1 and '1', or 'a/b' and a -> b, cannot name tensors "
                "apart; rename one of them"
            )
    return FlatState(skeleton=skeleton, tensors=flattener.tensors)


# ----------------------------------------------------------------------------- decoding


def _bad(node: Any, what: str = "node") -> FormatError:
    return FormatError(f"bad {what} {str(node)[:80]!r} in the state skeleton")


def _decode_scalar(tag: str, value: Any) -> Any:
    """Decode an int or float node; raise ``KeyError`` when ``tag`` is neither."""
    if tag == "i":
        if type(value) is not int:
            raise _bad({tag: value})
        return value
    if tag == "ix":
        if type(value) is not str:
            raise _bad({tag: value})
        try:
            return int(value, 16)
        except ValueError:
            raise _bad({tag: value}) from None
    if tag == "f":
        # 1e999 parses as inf; the writer never stores a non-finite value this way.
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _bad({tag: value})
        return float(value)
    if tag == "fb":
        if type(value) is not str or len(value) != 16:
            raise _bad({tag: value})
        try:
            return _DOUBLE.unpack(_BITS.pack(int(value, 16)))[0]
        except ValueError:
            raise _bad({tag: value}) from None
    raise KeyError(tag)


def _decode_key(node: Any) -> Any:
    if type(node) is str:
        if _has_surrogates(node):
            raise _bad(node, "dict key (surrogate code points)")
        return node
    if type(node) is dict and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "b" and type(value) is bool:
            return value
        if tag == "n" and value is None:
            return None
        try:
            return _decode_scalar(tag, value)
        except KeyError:
            pass
    raise _bad(node, "dict key")


def _decode_leaf(tag: str, value: Any) -> Any:
    if tag == "s" and type(value) is str:
        if _has_surrogates(value):
            raise _bad(value, "string (surrogate code points)")
        return value
    if tag == "y" and type(value) is str:
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise _bad({tag: value}) from None
    if tag == "dt" and type(value) is str:
        dtype = _DTYPES_BY_NAME.get(value)
        if dtype is None:
            raise FormatError(f"unknown dtype {value[:40]!r} in the state skeleton")
        return dtype
    if tag == "sz" and type(value) is list and all(type(v) is int and 0 <= v < 1 << 63 for v in value):
        return torch.Size(value)
    try:
        return _decode_scalar(tag, value)
    except KeyError:
        raise _bad({tag: value}) from None


TensorLookup = Callable[[int, KeyPath], Any]


def _rebuild(node: Any, path: KeyPath, lookup: TensorLookup) -> Any:
    if node is None or type(node) is bool:
        return node
    if type(node) is not dict or len(node) != 1:
        raise _bad(node)
    ((tag, value),) = node.items()
    if tag in ("d", "od", "l", "tu"):
        if type(value) is not list:
            raise _bad(node)
        if len(path) >= MAX_DEPTH:
            raise FormatError(f"state skeleton is nested deeper than {MAX_DEPTH} levels")
        if tag in ("l", "tu"):
            items = [_rebuild(item, path + (i,), lookup) for i, item in enumerate(value)]
            return items if tag == "l" else tuple(items)
        result: dict = {} if tag == "d" else OrderedDict()
        for item in value:
            if type(item) is not list or len(item) != 2:
                raise _bad(item, "dict item")
            key = _decode_key(item[0])
            if key in result:
                raise FormatError(f"dict key {key!r} appears twice at {format_key_path(path)} in the state skeleton")
            result[key] = _rebuild(item[1], path + (_key_part(key),), lookup)
        return result
    if tag == "t":
        if type(value) is not int:
            raise _bad(node)
        return lookup(value, path)
    return _decode_leaf(tag, value)


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the state from a skeleton and its tensors (the inverse of :func:`flatten`).

    Raises:
        FormatError: the skeleton is malformed or points at a tensor that does not exist.
    """

    def lookup(index: int, path: KeyPath) -> torch.Tensor:
        if not 0 <= index < len(tensors):
            raise FormatError(f"state skeleton points at missing tensor {index} at {format_key_path(path)}")
        return tensors[index]

    return _rebuild(skeleton, (), lookup)


def tensor_paths(skeleton: Any) -> dict[int, KeyPath]:
    """Map each tensor index in ``skeleton`` to the first key path it appears at.

    Validates the whole skeleton on the way.

    Raises:
        FormatError: the skeleton is malformed.
    """
    found: dict[int, KeyPath] = {}

    def record(index: int, path: KeyPath) -> None:
        if index < 0:
            raise FormatError(f"state skeleton points at missing tensor {index} at {format_key_path(path)}")
        found.setdefault(index, path)

    _rebuild(skeleton, (), record)
    return found
