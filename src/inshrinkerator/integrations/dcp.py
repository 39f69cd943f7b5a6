"""``torch.distributed.checkpoint`` (DCP): every rank compresses and writes its own shard.

::

    import torch.distributed.checkpoint as dcp
    from inshrinkerator.integrations.dcp import (
        InkLoadPlanner, InkSavePlanner, InkStorageReader, InkStorageWriter)

    dcp.save(state, storage_writer=InkStorageWriter("ckpt/step-100"), planner=InkSavePlanner())
    dcp.load(state, storage_reader=InkStorageReader("ckpt/step-100"), planner=InkLoadPlanner())
    dcp.async_save(state, storage_writer=InkStorageWriter(...), planner=InkSavePlanner())

Layout of a checkpoint folder: one ``__{rank}.ink`` per rank (that rank's tensor chunks,
compressed by the policy, and its plain values), and ``.metadata.json``, written last by
the coordinator as the commit marker. A shard keeps each value at its place in the state
dict (DCP's planner knows it), so a policy sees an optimizer's moments as moments, not as
weights; the file's header maps each chunk to that place. Nothing is pickled: DCP's own metadata and its
non-tensor items are ``torch.save`` pickles, here the metadata is JSON and the planners
carry non-tensor values as JSON too, so loading never unpickles. Chunks keep DCP's
offsets, so a checkpoint loads onto a different sharding.

Deltas across checkpoints: give every writer of a run one :class:`InkKeyframes`, made once
per process. Each rank's file is then a delta against a keyframe of that rank's (a full
checkpoint of its chunks, a new one every ``full_every`` saves) under
``.ink-keyframes/__{rank}/`` of the keyframes' folder, deleted once no checkpoint needs it::

    keyframes = InkKeyframes("ckpt", full_every=10)
    dcp.save(state, storage_writer=InkStorageWriter("ckpt/step-200", keyframes=keyframes),
             planner=InkSavePlanner())
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import threading
import uuid
from collections import defaultdict
from typing import Any, Optional, Union

import fsspec
import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..codecs.base import dtype_from_name
from ..errors import CheckpointNotFoundError, FormatError, InkError, UnsupportedStateError
from ..policies import Policy
from ..serialize import write_state
from ..single_file import _write_whole, open_container
from ..store import policy_or_default
from ..tree import flatten, unflatten
from ._keyframes import (
    KEYFRAME_DIR,
    KeyframeStore,
    checked_full_every,
    join,
    location,
    read_with_keyframe,
)

__all__ = [
    "InkKeyframes", "InkStorageWriter", "InkStorageReader", "InkSavePlanner", "InkLoadPlanner", "METADATA_FILE",
    "is_dcp_checkpoint", "dcp_shards", "verify_dcp", "read_dcp",
]

#: The commit marker: a checkpoint folder without it was never finished.
METADATA_FILE = ".metadata.json"
_FORMAT = "inshrinkerator-dcp"
_VERSION = 1
_MAX_METADATA_BYTES = 256 << 20


# -- planners: non-tensor values as JSON instead of torch.save pickles ----------------------


def _value_to_json(value: Any, fqn: str) -> io.BytesIO:
    flat = flatten(value)
    if flat.tensors:
        raise UnsupportedStateError(
            f"DCP item {fqn} mixes tensors into a plain value; put tensors directly in the state dict"
        )
    return io.BytesIO(json.dumps(flat.skeleton, separators=(",", ":")).encode("utf-8"))


def _value_from_json(data: bytes, where: str) -> Any:
    try:
        skeleton = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise FormatError(f"{where}: bad plain value ({error})") from None
    return unflatten(skeleton, [])


class InkSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that serializes non-tensor values as JSON (never pickle)."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if write_item.type == WriteItemType.BYTE_IO:
            return _value_to_json(object, write_item.index.fqn)
        return object


class InkLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values back from JSON (never unpickles)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        decoded = _value_from_json(value.getvalue(), f"item {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded


# -- metadata as JSON -----------------------------------------------------------------------


def _index_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offset}"


def _metadata_to_json(metadata: Metadata, storage: dict[str, dict[str, str]]) -> bytes:
    items: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes"}
        else:
            items[fqn] = {
                "kind": "tensor",
                "dtype": str(entry.properties.dtype).removeprefix("torch."),
                "requires_grad": bool(entry.properties.requires_grad),
                "size": [int(s) for s in entry.size],
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in entry.chunks
                ],
            }
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    document = {
        "format": _FORMAT,
        "version": _VERSION,
        "items": items,
        "planner_data": {fqn: list(path) for fqn, path in mappings.items()},
        "storage": storage,
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8")


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise FormatError(f"{where}: expected a list of non-negative ints, got {str(value)[:80]}")
    return value


def _metadata_from_json(data: bytes, source: str) -> tuple[Metadata, dict[str, dict[str, str]]]:
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise FormatError(f"{source}: not a JSON metadata file ({error})") from None
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        raise FormatError(f"{source}: not an inshrinkerator DCP checkpoint")
    if document.get("version") != _VERSION:
        raise FormatError(f"{source}: DCP layout version {document.get('version')!r} is not supported")
    items, mappings, storage = document.get("items"), document.get("planner_data"), document.get("storage")
    if not isinstance(items, dict) or not isinstance(mappings, dict) or not isinstance(storage, dict):
        raise FormatError(f"{source}: metadata lacks items, planner_data or storage")
    state_dict_metadata: dict[str, Any] = {}
    for fqn, entry in items.items():
        where = f"{source}: item {fqn}"
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind == "bytes":
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        if kind != "tensor" or not isinstance(entry.get("chunks"), list):
            raise FormatError(f"{where}: bad entry")
        try:
            dtype = dtype_from_name(entry["dtype"])
        except (KeyError, ValueError, TypeError):
            raise FormatError(f"{where}: unknown dtype {entry.get('dtype')!r}") from None
        chunks = []
        for chunk in entry["chunks"]:
            if not isinstance(chunk, dict):
                raise FormatError(f"{where}: bad chunk")
            chunks.append(ChunkStorageMetadata(
                offsets=torch.Size(_int_list(chunk.get("offsets"), where)),
                sizes=torch.Size(_int_list(chunk.get("sizes"), where)),
            ))
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=bool(entry.get("requires_grad"))),
            size=torch.Size(_int_list(entry.get("size"), where)),
            chunks=chunks,
        )
    planner_data = {}
    for fqn, path in mappings.items():
        if not isinstance(path, list) or not all(
            isinstance(p, (str, int)) and not isinstance(p, bool) for p in path
        ):
            raise FormatError(f"{source}: bad planner path for {fqn}")
        planner_data[fqn] = tuple(path)
    for key, place in storage.items():
        if not (isinstance(place, dict) and isinstance(place.get("file"), str)
                and isinstance(place.get("key"), str) and _is_shard_name(place["file"])):
            raise FormatError(f"{source}: bad storage entry for {key}")
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data), storage


def _is_shard_name(name: str) -> bool:
    return name.startswith("__") and name.endswith(".ink") and "/" not in name and "\\" not in name


#: A shard's header entry: chunk key -> the place of its value in the shard's state.
_PLACES_KEY = "dcp_places"


def _is_place(place: Any) -> bool:
    """Whether ``place`` is a non-empty list of dict keys (str or int) in a shard's state."""
    return isinstance(place, list) and bool(place) and all(
        isinstance(part, (str, int)) and not isinstance(part, bool) for part in place
    )


def _shard_state(entries: list[tuple[str, Any]], item_paths: list[Any]) -> tuple[dict[str, Any], dict[str, list]]:
    """A shard's values nested at their places in the state dict, and each chunk's place.

    ``item_paths`` are the places DCP's planner flattened the items from (its ``mappings``;
    None where it has none). A value goes there unless another chunk of this shard took the
    place or the place does not fit; then it stays at the top level, under its chunk key
    (which holds an ``@``, so it is no state dict's key)."""
    state: dict[str, Any] = {}
    places: dict[str, list] = {}
    for (key, value), path in zip(entries, item_paths):
        place = list(path) if isinstance(path, (list, tuple)) else None
        if not _is_place(place) or not _put(state, place, value):
            place = [key]
            if not _put(state, place, value):
                raise ValueError(f"DCP item {key} is in this shard twice")
        places[key] = place
    return state, places


def _put(state: dict, place: list, value: Any) -> bool:
    """Store ``value`` at ``place`` in the nested dicts of ``state``, if the place is free."""
    node = state
    for part in place[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return False
        node = child
    if place[-1] in node:
        return False
    node[place[-1]] = value
    return True


def _read_shard(source: str, store: Optional[KeyframeStore] = None, verify: bool = False) -> tuple[dict, Optional[dict]]:
    """A shard's decoded state (against its keyframe, if it names one; through ``store``,
    which may take that keyframe over) and its places (None: a shard written flat, before
    shards kept their values' places). ``verify``: every checksum of the file first.

    Raises:
        FormatError: not a DCP shard; and what reading the file raises.
    """
    if store is not None:
        shard, meta = store.read(source)
    else:
        with open_container(source) as reader:
            if verify:
                reader.verify()
            shard, meta = read_with_keyframe(reader, source), reader.meta
    places = meta.get(_PLACES_KEY)
    if not isinstance(shard, dict) or not isinstance(places, (dict, type(None))):
        raise FormatError(f"{source}: not a DCP shard")
    return shard, places


def _stored(shard: dict, places: Optional[dict], key: str, where: str) -> Any:
    """The value a shard (from :func:`_read_shard`) holds for the chunk ``key``."""
    if places is None:
        if key not in shard:
            raise FormatError(f"{where}: not in the shard")
        return shard[key]
    place = places.get(key)
    if not _is_place(place):
        raise FormatError(f"{where}: bad place {str(place)[:80]}")
    node: Any = shard
    for part in place:
        if not isinstance(node, dict) or part not in node:
            raise FormatError(f"{where}: the shard holds nothing at {place}")
        node = node[part]
    return node


def _rank() -> int:
    """This process's rank (0 without a process group)."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


def _completed(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


# -- keyframes: deltas across checkpoints ---------------------------------------------------


class InkKeyframes:
    """The keyframes that make a run's DCP checkpoints deltas: one object per process,
    handed to each :class:`InkStorageWriter` of the run.

    Args:
        folder: where the keyframes live (``folder/.ink-keyframes/__{rank}/``), usually the
            folder that holds the checkpoint folders; a local path or an fsspec URL, on the
            same store as the checkpoints.
        policy: a policy name, spec or object for every shard (default: the manager's
            default policy).
        full_every: a rank writes a new keyframe every this many of its saves.

    A rank's shard is stored against the keyframe as a reader decodes it (closed loop), so
    a lossy policy's error does not add up from checkpoint to checkpoint. Each shard file
    names its keyframe, and a reader finds it by itself: loading needs no
    ``InkKeyframes``. A keyframe is deleted when a rank writes the next one, or at
    :meth:`collect`, once no checkpoint file refers to it: call :meth:`collect` after
    deleting old checkpoint folders. A process that starts again (a resumed run) writes a
    new keyframe at its first save, unless it loads through an
    ``InkStorageReader(..., keyframes=keyframes)``: a rank that reads its own shard of a
    checkpoint stored against a keyframe of these goes on with that keyframe.
    """

    def __init__(
        self, folder: Union[str, "os.PathLike[str]"], policy: Union[str, Policy, None] = None,
        full_every: int = 10,
    ) -> None:
        self.full_every = checked_full_every(full_every)
        self.folder = location(folder)
        self.policy = policy_or_default(policy)
        self._stores: dict[str, KeyframeStore] = {}
        self._lock = threading.Lock()

    def store(self, shard: str) -> KeyframeStore:
        """The keyframe store of the rank that writes ``shard`` (``__{rank}.ink``)."""
        if not _is_shard_name(shard):
            raise ValueError(f"not a shard file name: {shard!r}")
        with self._lock:
            store = self._stores.get(shard)
            if store is None:
                root = join(self.folder, KEYFRAME_DIR, shard[: -len(".ink")])
                store = KeyframeStore(root, self.policy, self.full_every)
                self._stores[shard] = store
            return store

    def collect(self) -> None:
        """Delete this process's keyframes that no checkpoint file refers to any more."""
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            store.collect()

    def close(self) -> None:
        """Stop: the next save writes a new keyframe; unneeded keyframes are deleted."""
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            store.close()


# -- storage --------------------------------------------------------------------------------


class InkStorageWriter(StorageWriter):
    """Writes each rank's chunks into one compressed ``__{rank}.ink`` file.

    Args:
        path: the checkpoint folder (local path or fsspec URL); ``dcp.save(checkpoint_id=...)``
            may set it instead.
        policy: a policy name, spec (``"dynaquant:tolerance=0.01"``) or object (default:
            the manager's default policy).
        keyframes: the run's :class:`InkKeyframes`: the shard is stored as a delta against
            this rank's keyframe, with the keyframes' policy (then ``policy`` must be None).

    After a save, :attr:`last_shard` holds this rank's file name and :attr:`last_info`
    its sizes (``raw_bytes``, ``stored_bytes``; with keyframes, ``stored_bytes`` counts a
    keyframe written by this save too).
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None,
                 policy: Union[str, Policy, None] = None, keyframes: Optional[InkKeyframes] = None) -> None:
        super().__init__()
        if keyframes is not None and not isinstance(keyframes, InkKeyframes):
            raise TypeError(f"keyframes must be an InkKeyframes, got {type(keyframes).__name__}")
        if keyframes is not None and policy is not None:
            raise ValueError("with keyframes, give the policy to InkKeyframes (every shard of a run uses its policy)")
        self.path = os.fspath(path) if path is not None else None
        self.keyframes = keyframes
        self.policy = keyframes.policy if keyframes is not None else policy_or_default(policy)
        self.last_shard: Optional[str] = None
        self.last_info: dict[str, int] = {}
        self._is_coordinator = False

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("InkStorageWriter needs a path (or dcp.save(checkpoint_id=...))")
        if self.keyframes is not None and ("://" in self.path) != ("://" in self.keyframes.folder):
            raise ValueError(
                f"the checkpoint {self.path} and the keyframes {self.keyframes.folder} must be on one "
                "store (both local paths, or both URLs)"
            )
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{rank}.ink") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        name = plan.storage_data
        if not isinstance(name, str) or not _is_shard_name(name):
            raise ValueError("InkStorageWriter.write_data got a plan it did not prepare")
        if any(item.type == WriteItemType.BYTE_IO for item in plan.items) and not isinstance(
            planner, InkSavePlanner
        ):
            raise TypeError(
                "InkStorageWriter needs planner=InkSavePlanner(): DCP's default planner pickles "
                "non-tensor values, which this checkpoint format refuses"
            )
        entries: list[tuple[str, Any]] = []
        results = []
        for item in plan.items:
            key = _index_key(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                value: Any = data.getvalue()
                size = len(value)
            else:
                value = data.detach()
                size = value.numel() * value.element_size()
            entries.append((key, value))
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data={"file": name, "key": key}))
        mappings = getattr(planner, "mappings", None)
        paths = [mappings.get(item.index.fqn) if isinstance(mappings, dict) else None for item in plan.items]
        shard, places = _shard_state(entries, paths)
        meta = {"dcp_shard": name, _PLACES_KEY: places}
        fs, root = fsspec.core.url_to_fs(self.path)
        fs.makedirs(root, exist_ok=True)
        target = join(location(self.path), name)
        # Written under a temporary name and moved into place, as every file here is.
        if self.keyframes is not None:
            info = self.keyframes.store(name).save(shard, target, meta=meta)
            raw, stored = info.raw_bytes, info.stored_bytes
        else:
            written = _write_whole(target, lambda out: write_state(out, shard, self.policy, meta=meta))
            raw, stored = written.raw_bytes, written.stored_bytes
        self.last_shard = name
        self.last_info = {"raw_bytes": raw, "stored_bytes": stored}
        return _completed(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {_index_key(r.index): r.storage_data for rank in results for r in rank}
        fs, root = fsspec.core.url_to_fs(self.path)
        temporary = f"{root}/.{METADATA_FILE}.{uuid.uuid4().hex[:8]}.tmp"
        with fs.open(temporary, "wb") as out:
            out.write(_metadata_to_json(metadata, storage))
        fs.mv(temporary, f"{root}/{METADATA_FILE}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class InkStorageReader(StorageReader):
    """Reads a checkpoint written by :class:`InkStorageWriter`; never unpickles.

    Args:
        path: the checkpoint folder (or ``dcp.load(checkpoint_id=...)``).
        keyframes: the run's :class:`InkKeyframes`, when the process goes on saving
            through it: a rank that reads its own shard (``__{rank}.ink``), stored against
            a keyframe of these, takes that keyframe over, so its next save is a delta
            (not needed to read: a shard names its keyframe).

    After a load, :attr:`shards_read` lists the ``__{rank}.ink`` files this rank decoded.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None,
                 keyframes: Optional[InkKeyframes] = None) -> None:
        super().__init__()
        if keyframes is not None and not isinstance(keyframes, InkKeyframes):
            raise TypeError(f"keyframes must be an InkKeyframes, got {type(keyframes).__name__}")
        self.path = os.fspath(path) if path is not None else None
        self.keyframes = keyframes
        self.shards_read: list[str] = []
        self._storage: dict[str, dict[str, str]] = {}

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.shards_read = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, parsed from JSON.

        Raises:
            CheckpointNotFoundError: no committed checkpoint at the path.
            FormatError: the metadata is not valid.
        """
        if self.path is None:
            raise ValueError("InkStorageReader needs a path (or dcp.load(checkpoint_id=...))")
        fs, root = fsspec.core.url_to_fs(self.path)
        source = f"{self.path}/{METADATA_FILE}"
        try:
            with fs.open(f"{root}/{METADATA_FILE}", "rb") as handle:
                data = handle.read(_MAX_METADATA_BYTES + 1)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{source}: no such file; the folder holds no finished inshrinkerator DCP checkpoint"
            ) from None
        if len(data) > _MAX_METADATA_BYTES:
            raise FormatError(f"{source}: metadata larger than {_MAX_METADATA_BYTES} bytes")
        metadata, self._storage = _metadata_from_json(data, source)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._storage:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        by_file: dict[str, list[tuple[ReadItem, str]]] = defaultdict(list)
        for item in plan.items:
            place = self._storage.get(_index_key(item.storage_index))
            if place is None:
                raise FormatError(f"{self.path}: no stored data for {_index_key(item.storage_index)}")
            by_file[place["file"]].append((item, place["key"]))
        own = f"__{_rank()}.ink"
        for name, items in by_file.items():
            source = f"{self.path}/{name}"
            store = self.keyframes.store(name) if self.keyframes is not None and name == own else None
            shard, places = _read_shard(source, store)
            self.shards_read.append(name)
            for item, key in items:
                where = f"{source}: {key}"
                value = _stored(shard, places, key, where)
                if item.type == LoadItemType.BYTE_IO:
                    if not isinstance(value, bytes):
                        raise FormatError(f"{where}: expected a plain value")
                    if not isinstance(planner, InkLoadPlanner):
                        raise TypeError(
                            "InkStorageReader needs planner=InkLoadPlanner() for non-tensor values "
                            "(DCP's default planner would unpickle them)"
                        )
                    planner.load_bytes(item, io.BytesIO(value))
                    continue
                if not isinstance(value, torch.Tensor):
                    raise FormatError(f"{where}: expected a tensor")
                source = value
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.shape != source.shape:
                    raise FormatError(f"{where}: stored chunk {list(source.shape)} does not fit {list(target.shape)}")
                target.copy_(source)
                planner.commit_tensor(item, target)
        return _completed(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# -- inspection (inshrink info / verify on a checkpoint folder) -----------------------------


def is_dcp_checkpoint(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether ``path`` is a folder holding a finished checkpoint of :class:`InkStorageWriter`
    (its ``.metadata.json``)."""
    try:
        fs, root = fsspec.core.url_to_fs(os.fspath(path))
        return bool(fs.isdir(root) and fs.isfile(f"{root.rstrip('/')}/{METADATA_FILE}"))
    except Exception:  # noqa: BLE001 - unreachable, unknown protocol...: not one; the caller's own open says why
        return False


def dcp_shards(path: Union[str, "os.PathLike[str]"]) -> list[str]:
    """The shard files (``__{rank}.ink``) the checkpoint at ``path`` stores its items in.

    Raises:
        CheckpointNotFoundError / FormatError: as :meth:`InkStorageReader.read_metadata`.
    """
    reader = InkStorageReader(path)
    reader.read_metadata()
    return sorted({place["file"] for place in reader._storage.values()})


def verify_dcp(path: Union[str, "os.PathLike[str]"]) -> list[str]:
    """Check a checkpoint folder of :class:`InkStorageWriter`: its metadata parses, every
    shard it names is intact and decodes (against its keyframe, if any), and every item
    the metadata stores is in its shard with the size the metadata gives. Returns the
    problems found (empty: all good)."""
    folder = os.fspath(path)
    reader = InkStorageReader(folder)
    try:
        metadata = reader.read_metadata()
    except InkError as error:
        return [str(error)]
    sizes = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                sizes[_index_key(MetadataIndex(fqn, chunk.offsets))] = list(chunk.sizes)
    problems: list[str] = []
    by_file: dict[str, list[str]] = defaultdict(list)
    for key, place in reader._storage.items():
        by_file[place["file"]].append(place["key"])
    for name, keys in sorted(by_file.items()):
        source = f"{folder}/{name}"
        try:
            shard, places = _read_shard(source, verify=True)
            for key in keys:
                where = f"{source}: {key}"
                value = _stored(shard, places, key, where)
                if key in sizes and (not isinstance(value, torch.Tensor) or list(value.shape) != sizes[key]):
                    raise FormatError(f"{where}: stored {getattr(value, 'shape', type(value).__name__)}, "
                                      f"the metadata says {sizes[key]}")
        except InkError as error:
            problems.append(str(error))
    return problems


def read_dcp(path: Union[str, "os.PathLike[str]"]) -> dict[str, Any]:
    """The whole state a checkpoint folder of :class:`InkStorageWriter` holds, each tensor
    assembled from its chunks (whatever the sharding), nested as the saved state dict was:
    what ``inshrink decompress`` writes as one plain file. Needs no process group.

    Raises:
        CheckpointNotFoundError / FormatError / CorruptCheckpointError / BrokenChainError:
            the folder is no finished checkpoint, or a file is damaged or missing.
    """
    from torch.distributed.checkpoint._traverse import set_element

    folder = os.fspath(path)
    reader = InkStorageReader(folder)
    metadata = reader.read_metadata()
    storage = reader._storage
    shards = {name: _read_shard(f"{folder}/{name}") for name in sorted({place["file"] for place in storage.values()})}

    def stored(key: str) -> Any:
        place = storage.get(key)
        if place is None:
            raise FormatError(f"{folder}: no stored data for {key}")
        return _stored(*shards[place["file"]], place["key"], f"{folder}/{place['file']}: {key}")

    state: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        where = f"{folder}: item {fqn}"
        if isinstance(entry, BytesStorageMetadata):
            data = stored(_index_key(MetadataIndex(fqn)))
            if not isinstance(data, bytes):
                raise FormatError(f"{where}: expected a plain value")
            value: Any = _value_from_json(data, where)
        else:
            parts = []
            for chunk in entry.chunks:
                part = stored(_index_key(MetadataIndex(fqn, chunk.offsets)))
                if (not isinstance(part, torch.Tensor) or list(part.shape) != list(chunk.sizes)
                        or len(chunk.offsets) != len(entry.size)):
                    raise FormatError(f"{where}: a stored chunk does not match its metadata")
                parts.append((chunk.offsets, part))
            # Checked before anything is allocated: the chunks, which were decoded, must
            # hold as many values as the tensor the metadata claims.
            numel = math.prod(entry.size)
            covered = sum(part.numel() for _, part in parts)
            if covered != numel:
                raise FormatError(f"{where}: its chunks hold {covered} of its {numel} values")
            value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for offsets, part in parts:
                target = value
                for dim, (offset, length) in enumerate(zip(offsets, part.shape)):
                    if offset + length > target.shape[dim]:
                        raise FormatError(f"{where}: a chunk lies outside the tensor")
                    target = target.narrow(dim, offset, length)
                target.copy_(part.to(value.dtype))
        place = metadata.planner_data.get(fqn, (fqn,)) if isinstance(metadata.planner_data, dict) else (fqn,)
        set_element(state, tuple(place), value)
    return state
