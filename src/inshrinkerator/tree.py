"""Flatten a nested training state into key paths and back, exactly.

A state is what people checkpoint today: nested ``dict`` / ``OrderedDict`` /
``list`` / ``tuple`` holding tensors and plain values (``int``, ``float``,
``bool``, ``str``, ``None``; also ``bytes``, ``torch.dtype`` and ``torch.Size``).
:func:`flatten` turns it into a JSON-safe *skeleton* plus a list of tensor
leaves; :func:`unflatten` rebuilds the identical structure (container types,
key types and key order preserved).

Tensors that are the very same view of the same storage (same storage, offset,
shape, stride and dtype) are stored once and come back as one tensor object,
so tied weights stay tied.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Union

import torch

from .errors import FormatError, UnsupportedStateError

__all__ = ["KeyPath", "TensorLeaf", "FlatState", "flatten", "unflatten", "format_key_path"]

KeyPath = tuple[Union[str, int], ...]

# Deep nesting in a file's skeleton must not blow the interpreter's stack.
MAX_DEPTH = 200


@dataclass(frozen=True)
class TensorLeaf:
    """One distinct tensor of a state and the first key path it was found at."""

    path: KeyPath
    tensor: torch.Tensor


@dataclass
class FlatState:
    """A flattened state: a JSON-safe ``skeleton`` and the tensors it points at by index."""

    skeleton: Any
    tensors: list[TensorLeaf]


def format_key_path(path: KeyPath) -> str:
    """Render a key path for messages, e.g. ``optimizer/state/0/exp_avg``."""
    return "/".join(str(part) for part in path) if path else "<root>"


def _encode_float(value: float) -> Any:
    # JSON has no NaN/Inf and -0.0 loses its sign through some encoders: hex is exact.
    if math.isfinite(value) and not (value == 0.0 and math.copysign(1.0, value) < 0):
        return {"f": value}
    return {"fx": value.hex()}


def _encode_key(key: Any, path: KeyPath) -> Any:
    if isinstance(key, bool):
        return {"b": key}
    if isinstance(key, int):
        return {"i": key}
    if isinstance(key, str):
        return key
    if isinstance(key, float):
        return _encode_float(key)
    if key is None:
        return {"n": None}
    raise UnsupportedStateError(
        f"dict key {key!r} of type {type(key).__name__} at {format_key_path(path)} is not "
        "supported; use str, int, float, bool or None keys"
    )


def _key_part(key: Any) -> Union[str, int]:
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[TensorLeaf] = []
        self._seen: dict[tuple, int] = {}

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
        identity = (
            tensor.untyped_storage().data_ptr(),
            tensor.device,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        index = self._seen.get(identity) if tensor.numel() else None
        if index is None:
            index = len(self.tensors)
            self.tensors.append(TensorLeaf(path, tensor.detach()))
            if tensor.numel():
                self._seen[identity] = index
        return {"t": index}

    def visit(self, value: Any, path: KeyPath) -> Any:
        if len(path) > MAX_DEPTH:
            raise UnsupportedStateError(
                f"state is nested deeper than {MAX_DEPTH} levels at {format_key_path(path[:8])}/..."
            )
        if isinstance(value, torch.Tensor):
            return self.leaf_tensor(value, path)
        if value is None:
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return {"i": value}
        if isinstance(value, float):
            return _encode_float(value)
        if isinstance(value, str):
            return {"s": value}
        if isinstance(value, bytes):
            return {"y": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.dtype):
            return {"dt": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {"sz": list(value)}
        if isinstance(value, dict) and type(value) in (dict, OrderedDict):
            kind = "od" if type(value) is OrderedDict else "d"
            items = [
                [_encode_key(k, path), self.visit(v, path + (_key_part(k),))]
                for k, v in value.items()
            ]
            return {kind: items}
        if type(value) in (list, tuple):
            kind = "l" if type(value) is list else "tu"
            return {kind: [self.visit(v, path + (i,)) for i, v in enumerate(value)]}
        raise UnsupportedStateError(
            f"value of type {type(value).__module__}.{type(value).__qualname__} at "
            f"{format_key_path(path)} cannot be stored; a state holds tensors, dict/list/tuple "
            "and int/float/bool/str/bytes/None only (convert it, or leave it out of the state)"
        )


def flatten(state: Any) -> FlatState:
    """Split ``state`` into a JSON-safe skeleton and its distinct tensors.

    Raises:
        UnsupportedStateError: a leaf or key cannot be stored; the message names its key path.
    """
    flattener = _Flattener()
    skeleton = flattener.visit(state, ())
    return FlatState(skeleton=skeleton, tensors=flattener.tensors)


def _decode_float(node: dict) -> float:
    if "f" in node:
        value = node["f"]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise FormatError(f"bad float node {node!r} in the state skeleton")
        return float(value)
    text = node["fx"]
    if not isinstance(text, str):
        raise FormatError(f"bad float node {node!r} in the state skeleton")
    try:
        return float.fromhex(text)
    except ValueError:
        raise FormatError(f"bad float node {node!r} in the state skeleton") from None


def _decode_key(node: Any) -> Any:
    if isinstance(node, str):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, value), = node.items()
        if tag == "i" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tag == "b" and isinstance(value, bool):
            return value
        if tag == "n" and value is None:
            return None
        if tag in ("f", "fx"):
            return _decode_float(node)
    raise FormatError(f"bad dict key node {node!r} in the state skeleton")


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the state from a skeleton and its tensors (the inverse of :func:`flatten`).

    Raises:
        FormatError: the skeleton is malformed or points at a tensor that does not exist.
    """

    def build(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FormatError(f"state skeleton is nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, bool):
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise FormatError(f"bad node {str(node)[:80]!r} in the state skeleton")
        (tag, value), = node.items()
        if tag == "t":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tensors):
                raise FormatError(f"state skeleton points at missing tensor {value!r}")
            return tensors[value]
        if tag == "i" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tag in ("f", "fx"):
            return _decode_float(node)
        if tag == "s" and isinstance(value, str):
            return value
        if tag == "y" and isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                raise FormatError("bad bytes node in the state skeleton") from None
        if tag == "dt" and isinstance(value, str):
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"unknown dtype {value!r} in the state skeleton")
            return dtype
        if tag == "sz" and isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return torch.Size(value)
        if tag in ("d", "od") and isinstance(value, list):
            result: dict = {} if tag == "d" else OrderedDict()
            for item in value:
                if not isinstance(item, list) or len(item) != 2:
                    raise FormatError("bad dict item in the state skeleton")
                result[_decode_key(item[0])] = build(item[1], depth + 1)
            return result
        if tag in ("l", "tu") and isinstance(value, list):
            items = [build(v, depth + 1) for v in value]
            return items if tag == "l" else tuple(items)
        raise FormatError(f"bad node {str(node)[:80]!r} in the state skeleton")

    return build(skeleton, 0)


def tensor_paths(skeleton: Any) -> dict[int, KeyPath]:
    """Map each tensor index in ``skeleton`` to the first key path it appears at."""
    found: dict[int, KeyPath] = {}

    def walk(node: Any, path: KeyPath) -> None:
        if not isinstance(node, dict) or len(node) != 1:
            return
        (tag, value), = node.items()
        if tag == "t" and isinstance(value, int):
            found.setdefault(value, path)
        elif tag in ("d", "od") and isinstance(value, list):
            for item in value:
                if isinstance(item, list) and len(item) == 2:
                    key = _decode_key(item[0])
                    walk(item[1], path + (_key_part(key),))
        elif tag in ("l", "tu") and isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, path + (i,))

    walk(skeleton, ())
    return found
