"""A whole state <-> one container: flatten, plan codecs, encode, write; and back.

Shared by the one-shot :func:`inshrinkerator.save` / :func:`inshrinkerator.load`
and by the run store, which passes the previous reconstructed checkpoint as the
references.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Optional

import torch

from .codecs.base import Codec, TensorSpec
from .codecs.lossy_input import all_finite
from .container import ContainerReader, ContainerWriter
from .errors import BrokenChainError, FormatError
from .policies import Lossless, Policy
from .tree import TensorLeaf, flatten, format_key_path, tensor_paths, unflatten

__all__ = ["WrittenState", "write_state", "read_state", "reference_map", "ProgressCallback"]

#: Called after each tensor with (bytes done, bytes in all) of raw tensor data.
ProgressCallback = Callable[[int, int], None]

# read_state decodes this much raw tensor data at a time (in parallel) between progress calls.
_READ_BATCH_BYTES = 1 << 28


@dataclass
class WrittenState:
    """What :func:`write_state` wrote: sizes, and the state as a reader will see it."""

    raw_bytes: int
    stored_bytes: int
    used_reference: bool
    #: key path (formatted) -> the tensor a reader will decode (the closed-loop reference
    #: for the next delta).
    reconstruction: dict[str, torch.Tensor]


def reference_map(state: Any) -> dict[str, torch.Tensor]:
    """Formatted key path -> tensor for every distinct tensor of ``state``."""
    return {format_key_path(leaf.path): leaf.tensor for leaf in flatten(state).tensors}


def write_state(
    out: IO[bytes],
    state: Any,
    policy: Policy,
    references: Optional[Mapping[str, torch.Tensor]] = None,
    reference_name: str = "base",
    meta: Optional[dict[str, Any]] = None,
    keep_reconstruction: bool = False,
    progress: Optional[ProgressCallback] = None,
) -> WrittenState:
    """Encode ``state`` with ``policy`` into ``out``.

    Raises:
        UnsupportedStateError: the state holds something that cannot be stored.
    """
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    refs = [references.get(key) if references else None for key in keys]
    codecs = _exact_where_not_finite(flat.tensors, refs, policy.plan(flat.tensors, refs))
    writer = ContainerWriter()
    total = sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flat.tensors)
    raw_bytes = 0
    used_reference = False
    reconstruction: dict[str, torch.Tensor] = {}
    try:
        for leaf, key, codec, reference in zip(flat.tensors, keys, codecs, refs):
            tensor = leaf.tensor
            raw_bytes += tensor.numel() * tensor.element_size()
            # A codec that can produce its streams one at a time (encode_lazily) hands them
            # to the writer as they are made: a huge tensor never has all its output in memory.
            encode = getattr(codec, "encode_lazily", codec.encode)
            encoded = encode(tensor, reference if codec.uses_reference else None)
            used_reference |= codec.uses_reference
            writer.add(
                TensorSpec.of(tensor),
                codec.get_config(),
                encoded,
                reference=reference_name if codec.uses_reference else None,
            )
            if keep_reconstruction:
                rebuilt = encoded.reconstruction if encoded.reconstruction is not None else tensor
                reconstruction[key] = rebuilt
            if progress is not None:
                progress(raw_bytes, total)
        full_meta = {"policy": policy.name, "raw_bytes": raw_bytes, **(meta or {})}
        stored = writer.finish(out, flat.skeleton, full_meta)
    finally:
        writer.close()
    return WrittenState(raw_bytes, stored, used_reference, reconstruction)


def _exact_where_not_finite(
    leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]], codecs: Sequence[Codec]
) -> list[Codec]:
    """Lossless codecs for the tensors holding NaN or +-inf that a policy planned lossily.

    Quantizers cannot keep a NaN's sign and payload, and a non-finite value usually means
    the run diverged: such a tensor is worth more exact than small. Applies to every policy.
    """
    exact = Lossless()
    planned = list(codecs)
    for index, (leaf, codec) in enumerate(zip(leaves, planned)):
        tensor = leaf.tensor
        if codec.lossless or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if not all_finite(tensor):
            planned[index] = exact.plan([leaf], [references[index]])[0]
    return planned


def read_state(
    reader: ContainerReader,
    references: Optional[Mapping[str, torch.Tensor]] = None,
    reference_hint: str = "pass base= with the state it was saved against",
    progress: Optional[ProgressCallback] = None,
) -> Any:
    """Decode every tensor of an open container and rebuild the state.

    Raises:
        BrokenChainError: a tensor was stored as a delta and its reference is missing.
        FormatError / CorruptCheckpointError: the file is invalid or damaged.
    """
    header = reader.header
    paths = tensor_paths(header.skeleton)
    if set(paths) != set(range(len(header.tensors))):
        raise FormatError(f"{reader.source}: skeleton and tensor records disagree")
    references_in_order: list[Optional[torch.Tensor]] = []
    wheres = []
    for index, record in enumerate(header.tensors):
        key = format_key_path(paths[index])
        reference = None
        if record.reference is not None:
            reference = references.get(key) if references else None
            if reference is None:
                raise BrokenChainError(
                    f"{reader.source}: tensor {key} is stored as a delta against "
                    f"{record.reference!r}, which was not given; {reference_hint}"
                )
        references_in_order.append(reference)
        wheres.append(f"tensor {key}")
    # Tensors decode in parallel, in batches of about _READ_BATCH_BYTES of raw data, so that
    # progress is reported as it happens.
    tensors: list[torch.Tensor] = []
    total = sum(record.spec.nbytes for record in header.tensors)
    done = 0
    start = 0
    while start < len(header.tensors):
        end, batch_bytes = start, 0
        while end < len(header.tensors) and (end == start or batch_bytes < _READ_BATCH_BYTES):
            batch_bytes += header.tensors[end].spec.nbytes
            end += 1
        tensors += reader.decode_many(header.tensors[start:end], references_in_order[start:end], wheres[start:end])
        done += batch_bytes
        start = end
        if progress is not None:
            progress(done, total)
    return unflatten(header.skeleton, tensors)
