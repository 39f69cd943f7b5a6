"""Read and write the formats people already have: ``.pt``/``.pth``, ``.safetensors`` and ``.ink``.

``.pt`` files are opened with ``torch.load(weights_only=True)``, which refuses
arbitrary pickled objects, so converting a file never runs code from it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from .container.format import MAGIC
from .errors import CheckpointNotFoundError, FormatError, UnsupportedStateError
from .single_file import PathLike, load

__all__ = ["read_any", "write_torch_or_safetensors", "TORCH_SUFFIXES", "SAFETENSORS_SUFFIX"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"


def _suffix(path: PathLike) -> str:
    return Path(os.fspath(path)).suffix.lower()


def _is_ink_file(source: str) -> bool:
    with open(source, "rb") as handle:
        return handle.read(len(MAGIC)) == MAGIC


def read_any(path: PathLike, base: Optional[Any] = None) -> Any:
    """The state in a ``.pt``/``.pth``/``.bin``, ``.safetensors`` or ``.ink`` file, or a
    Lightning ``.ckpt`` (an ``.ink`` file from ``InkCheckpointIO``, or weights-only torch).

    Raises:
        CheckpointNotFoundError: no such file.
        FormatError: the file is not of its suffix's format, or a ``.pt`` file needs
            arbitrary objects (which are never unpickled).
    """
    source = os.fspath(path)
    suffix = _suffix(source)
    if suffix != ".ink" and not Path(source).is_file():
        raise CheckpointNotFoundError(f"{source}: no such file")
    if suffix not in (".ink", SAFETENSORS_SUFFIX) and _is_ink_file(source):
        suffix = ".ink"  # e.g. a Lightning .ckpt written by InkCheckpointIO
    if suffix in TORCH_SUFFIXES or suffix == ".ckpt":
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            raise FormatError(
                f"{source}: cannot be read as a weights-only torch file ({str(exc).splitlines()[0][:160]}); "
                "only tensors and plain containers are accepted, never arbitrary pickled objects"
            ) from None
    if suffix == SAFETENSORS_SUFFIX:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(source, device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise FormatError(f"{source}: not a valid safetensors file ({exc})") from None
    if suffix == ".ink":
        return load(source, base=base)
    raise FormatError(
        f"{source}: unknown input suffix {suffix!r}; use .pt, .pth, .bin, .ckpt, .safetensors or .ink"
    )


def write_torch_or_safetensors(state: Any, path: PathLike) -> None:
    """Write ``state`` as ``.pt``/``.pth``/``.bin`` (torch.save) or ``.safetensors``, by suffix.

    Raises:
        UnsupportedStateError: ``.safetensors`` holds only a flat ``{name: tensor}`` dict.
        FormatError: an unknown suffix.
    """
    destination = os.fspath(path)
    suffix = _suffix(destination)
    Path(destination).parent.mkdir(parents=True, exist_ok=True)
    if suffix in TORCH_SUFFIXES:
        torch.save(state, destination)
        return
    if suffix == SAFETENSORS_SUFFIX:
        from safetensors.torch import save_file

        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise UnsupportedStateError(
                f"{destination}: .safetensors holds a flat {{name: tensor}} dict only; this state "
                "is nested or holds plain values — write a .pt file instead"
            )
        # safetensors refuses tensors that share memory; give each its own copy.
        seen: set[int] = set()
        tensors = {}
        for name, tensor in state.items():
            pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
            tensors[name] = tensor.clone().contiguous() if pointer in seen else tensor.contiguous()
            if pointer:
                seen.add(pointer)
        save_file(tensors, destination)
        return
    raise FormatError(
        f"{destination}: unknown output suffix {suffix!r}; use .pt, .pth, .bin or .safetensors"
    )
