"""The codec contract: pure ``tensor <-> bytes`` transforms, described by JSON configs.

A codec turns one tensor into one or more byte *streams* plus small JSON
*params* (what the decoder needs that depends on the data, such as a chunk
layout or a codebook), and back. Its *config* (``get_config()``) holds the
options chosen by a policy; the container records config and params for every
tensor, so any file decodes without the policy that wrote it.

Codecs do no I/O. Delta codecs receive the ``reference`` tensor (the previous
reconstructed checkpoint, or a base model) from their caller; a codec that
``uses_context`` also receives its *context*, the reconstruction of another tensor of
the same file that is stored before it (e.g. the first moment whose zeros a second
moment shares), as ``context=`` of ``encode`` and ``decode``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from ..errors import BrokenChainError, FormatError

__all__ = [
    "Codec", "Encoded", "TensorSpec", "dtype_from_name", "dtype_name", "matching_reference", "same_bits", "Buffer",
]

Buffer = "bytes | bytearray | memoryview"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name of ``dtype`` in files, e.g. ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise FormatError(f"dtype {dtype} is not supported by the .ink format")
    return name


def dtype_from_name(name: Any) -> torch.dtype:
    """The dtype a file names; :class:`FormatError` for anything unknown."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise FormatError(f"unknown dtype {name!r} in file")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """What a decoded tensor must be: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tensor.dtype, tuple(tensor.shape))


def matching_reference(spec: TensorSpec, reference: Optional[torch.Tensor], stored_as: str) -> torch.Tensor:
    """``reference``, checked to be a tensor of ``spec``'s dtype and shape.

    Raises:
        BrokenChainError: it is missing, or it is not what the tensor (stored as
            ``stored_as``, e.g. "a residual") was taken against.
    """
    if reference is None:
        raise BrokenChainError(f"this tensor is stored as {stored_as}; its reference tensor is missing")
    if reference.dtype != spec.dtype or tuple(reference.shape) != spec.shape:
        raise BrokenChainError(
            f"the reference is {reference.dtype} {list(reference.shape)}, but {stored_as} was "
            f"taken against {spec.dtype} {list(spec.shape)}"
        )
    return reference


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes: NaN payloads and the sign of zero count (compared on
    ``a``'s device)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a_bytes = a.detach().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.detach().to(a.device).contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a_bytes, b_bytes)


@dataclass
class Encoded:
    """The output of :meth:`Codec.encode`.

    ``reconstruction`` is what :meth:`Codec.decode` will return, when the codec
    has it for free (lossy codecs); a caller that needs the decoded tensor for a
    closed-loop delta uses it instead of decoding again. Lossless codecs leave it
    ``None``: the input itself is the reconstruction.
    """

    streams: list[Any]
    params: dict[str, Any] = field(default_factory=dict)
    reconstruction: Optional[torch.Tensor] = None


class Codec(ABC):
    """A tensor codec. Subclasses set ``codec_id`` and implement encode/decode.

    The default :meth:`get_config` returns the public attributes plus ``id``;
    equality and repr derive from it.
    """

    codec_id: ClassVar[str]
    #: True when ``decode(encode(x)) == x`` bit for bit.
    lossless: ClassVar[bool] = True
    #: True when encode/decode need the reference tensor.
    uses_reference: ClassVar[bool] = False
    #: True when encode/decode also take ``context=``: the reconstruction of another tensor
    #: of the same file, named by the codec's ``context_key`` when it is planned.
    uses_context: ClassVar[bool] = False

    @abstractmethod
    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        """Encode ``tensor`` (any device; the bytes are produced on the CPU)."""

    @abstractmethod
    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Rebuild the tensor of ``spec``; :class:`FormatError` if the streams don't fit it."""

    def get_config(self) -> dict[str, Any]:
        config = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"id": self.codec_id, **config}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        options = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**options)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"bad config for codec {cls.codec_id!r}: {config!r} ({exc})") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({options})"
