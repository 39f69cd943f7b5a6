"""A whole state <-> one container: flatten, plan codecs, encode, write; and back.

Shared by the one-shot :func:`inshrinkerator.save` / :func:`inshrinkerator.load`
and by the run store, which passes the previous reconstructed checkpoint as the
references.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Optional

import torch

from .codecs._parallel import single_threaded_ops
from .codecs.base import Codec, Encoded, TensorSpec
from .codecs.lossy_input import all_finite
from .container import ContainerReader, ContainerWriter
from .container.format import context_depths
from .errors import BrokenChainError, FormatError
from .policies import Lossless, Policy
from .tree import TensorLeaf, flatten, format_key_path, unflatten

__all__ = [
    "WrittenState",
    "write_state",
    "read_state",
    "read_tensors",
    "referenced_keys",
    "tensor_keys",
    "reference_map",
    "ProgressCallback",
]

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


# Codec work runs torch operations on its own thread alone: the codec pool spreads it
# (codecs._parallel).
@single_threaded_ops()
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
    codecs = _exact_where_not_finite(flat.tensors, refs, policy.plan_state(state, flat.tensors, refs))
    contexts = _context_indices(keys, codecs)
    writer = ContainerWriter()
    total = sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flat.tensors)
    raw_bytes = 0
    used_reference = False
    reconstruction: dict[str, torch.Tensor] = {}
    # The reconstructions other tensors are encoded with (their contexts), by record index.
    context_records = set(contexts.values())
    kept: dict[int, torch.Tensor] = {}
    # Contexts stored after a record that needs them are encoded first, and held until
    # their turn.
    early: dict[int, Encoded] = {}

    def encode(index: int) -> Encoded:
        if index in early:
            return early.pop(index)
        codec, tensor = codecs[index], flat.tensors[index].tensor
        reference = refs[index] if codec.uses_reference else None
        context = contexts.get(index)
        if context is not None:
            if context not in kept:  # a context stored later (its own context first, if any)
                early[context] = encode(context)
            encoded = codec.encode(tensor, reference, context=kept[context])  # type: ignore[call-arg]
        elif index in context_records:
            encoded = codec.encode(tensor, reference)
        else:
            # A codec that can produce its streams one at a time (encode_lazily) hands them to
            # the writer as they are made: a huge tensor never has all its output in memory.
            return getattr(codec, "encode_lazily", codec.encode)(tensor, reference)
        if index in context_records:
            kept[index] = encoded.reconstruction if encoded.reconstruction is not None else tensor
        return encoded

    try:
        for index, (leaf, key, codec) in enumerate(zip(flat.tensors, keys, codecs)):
            tensor = leaf.tensor
            raw_bytes += tensor.numel() * tensor.element_size()
            encoded = encode(index)
            used_reference |= codec.uses_reference
            writer.add(
                TensorSpec.of(tensor),
                codec.get_config(),
                encoded,
                reference=reference_name if codec.uses_reference else None,
                context=contexts.get(index),
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


def _context_indices(keys: Sequence[str], codecs: Sequence[Codec]) -> dict[int, int]:
    """Record index -> the index of its context record, for the codecs that use one.

    Raises:
        ValueError: a codec's context is not another tensor of the state, or contexts run
            in a circle (a bug in the policy that planned them).
    """
    index_of = {key: index for index, key in enumerate(keys)}
    contexts: dict[int, int] = {}
    for index, codec in enumerate(codecs):
        if not codec.uses_context:
            continue
        key = getattr(codec, "context_key", None)
        context = index_of.get(key) if isinstance(key, str) else None
        if context is None or context == index:
            raise ValueError(
                f"{type(codec).__name__} for {keys[index]} was planned against context {key!r}, which "
                "is not another tensor of the state"
            )
        contexts[index] = context
    try:
        context_depths([contexts.get(index) for index in range(len(codecs))])
    except ValueError as exc:
        raise ValueError(f"the policy planned contexts that cannot be decoded: {exc}") from None
    return contexts


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
    keys = tensor_keys(reader)
    tensors = _decode(reader, keys, range(len(keys)), references, reference_hint, progress)
    return unflatten(reader.header.skeleton, tensors)


def read_tensors(
    reader: ContainerReader,
    wanted: Optional[Collection[str]],
    references: Optional[Mapping[str, torch.Tensor]] = None,
    reference_hint: str = "pass base= with the state it was saved against",
) -> dict[str, torch.Tensor]:
    """Decode only the tensors whose formatted key path is in ``wanted`` (all if None), and
    the context records they decode with (returned too).

    A chain restore decodes of a base step only what a later step is stored against. The
    other tensors' sections are still read and checksummed, so damage anywhere in a base
    still breaks the steps stored against it. Keys in ``wanted`` that the file does not
    hold are skipped. Errors as :func:`read_state`.
    """
    keys = tensor_keys(reader)
    indices = _with_contexts(reader, [i for i, key in enumerate(keys) if wanted is None or key in wanted])
    if len(indices) < len(keys):
        chosen = set(indices)
        for index, record in enumerate(reader.header.tensors):
            if index not in chosen:
                reader.check_record(record)  # CorruptCheckpointError on a damaged section
    tensors = _decode(reader, keys, indices, references, reference_hint, None)
    return {keys[i]: tensor for i, tensor in zip(indices, tensors)}


def referenced_keys(reader: ContainerReader, among: Optional[Collection[str]] = None) -> set[str]:
    """Formatted key paths whose tensors are stored against a reference: of all tensors, or
    of those a read of ``among`` decodes (``among`` and the contexts they decode with)."""
    keys = tensor_keys(reader)
    indices = _with_contexts(reader, [i for i, key in enumerate(keys) if among is None or key in among])
    return {keys[i] for i in indices if reader.header.tensors[i].reference is not None}


def _with_contexts(reader: ContainerReader, indices: Sequence[int]) -> list[int]:
    """``indices`` and the context records they decode with (and theirs), in record order."""
    records = reader.header.tensors
    needed = set(indices)
    pending = list(needed)
    while pending:
        context = records[pending.pop()].context
        if context is not None and context not in needed:
            needed.add(context)
            pending.append(context)
    return sorted(needed)


def tensor_keys(reader: ContainerReader) -> list[str]:
    """The formatted key path of each tensor record, in record order.

    Raises:
        FormatError: the skeleton and the tensor records disagree.
    """
    header = reader.header
    # The paths the header's parse found (and checked) in its skeleton: a chain restore
    # asks for the keys of each file twice, and walking a skeleton again took ~1.7 ms a
    # time on MiniLM's states (253 tensors).
    paths = header.tensor_paths
    if set(paths) != set(range(len(header.tensors))):
        raise FormatError(f"{reader.source}: skeleton and tensor records disagree")
    return [format_key_path(paths[index]) for index in range(len(header.tensors))]


@single_threaded_ops()
def _decode(
    reader: ContainerReader,
    keys: Sequence[str],
    indices: Sequence[int],
    references: Optional[Mapping[str, torch.Tensor]],
    reference_hint: str,
    progress: Optional[ProgressCallback],
) -> list[torch.Tensor]:
    """The tensors of records ``indices``, decoded against ``references`` by key."""
    records = [reader.header.tensors[index] for index in indices]
    references_in_order: list[Optional[torch.Tensor]] = []
    for index, record in zip(indices, records):
        reference = None
        if record.reference is not None:
            reference = references.get(keys[index]) if references else None
            if reference is None:
                raise BrokenChainError(
                    f"{reader.source}: tensor {keys[index]} is stored as a delta against "
                    f"{record.reference!r}, which was not given; {reference_hint}"
                )
        references_in_order.append(reference)
    wheres = [f"tensor {keys[index]}" for index in indices]
    # Tensors decode in parallel, in batches of about _READ_BATCH_BYTES of raw data, so that
    # progress is reported as it happens; those decoded with a context record after their
    # contexts: a wave per depth of the chains of contexts.
    position = {index: at for at, index in enumerate(indices)}
    for record in records:
        if record.context is not None and record.context not in position:
            raise ValueError("_decode needs the context records of the records it decodes")
    depths = context_depths([None if record.context is None else position[record.context] for record in records])
    waves = [[at for at, depth in enumerate(depths) if depth == wave] for wave in range(max(depths, default=-1) + 1)]
    tensors: list[Optional[torch.Tensor]] = [None] * len(records)
    total = sum(record.spec.nbytes for record in records)
    done = 0
    for wave in waves:
        start = 0
        while start < len(wave):
            end, batch_bytes = start, 0
            while end < len(wave) and (end == start or batch_bytes < _READ_BATCH_BYTES):
                batch_bytes += records[wave[end]].spec.nbytes
                end += 1
            batch = wave[start:end]
            contexts = [
                None if records[at].context is None else tensors[position[records[at].context]] for at in batch
            ]
            decoded = reader.decode_many(
                [records[at] for at in batch], [references_in_order[at] for at in batch], [wheres[at] for at in batch],
                contexts,
            )
            for at, tensor in zip(batch, decoded):
                tensors[at] = tensor
            done += batch_bytes
            start = end
            if progress is not None:
                progress(done, total)
    return tensors  # type: ignore[return-value]
