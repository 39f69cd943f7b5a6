"""Re-base: rewrite a delta step as a full checkpoint that decodes to the very same tensors.

Retention re-bases the oldest kept step before deleting the steps it depends on. The
next kept step is a delta against this step's *reconstruction*, so the rewrite must
reproduce that reconstruction bit for bit; then no later step needs re-encoding and
no lossy error is added. :class:`ExactRebasePolicy` keeps the run's policy wherever it
reproduces the tensor exactly and falls back to lossless coding elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import torch

from ..codecs.base import Codec, same_bits
from ..policies import Lossless, Policy
from ..serialize import write_state
from ..tree import TensorLeaf
from .chain import load_step
from .commit import publish_manifest, read_manifest, write_data
from .manifest import StepManifest
from .storage import RunStorage

__all__ = ["ExactRebasePolicy", "rebase_step"]


class ExactRebasePolicy(Policy):
    """``inner``'s codecs where they reproduce each tensor exactly, lossless ones elsewhere.

    No codec it returns uses a reference (or a context): the result is a full checkpoint.
    """

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self._fallback = Lossless()

    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        none: list[Optional[torch.Tensor]] = [None] * len(leaves)
        chosen = self.inner.plan(leaves, none)
        fallback = self._fallback.plan(leaves, none)
        codecs = []
        for leaf, codec, safe in zip(leaves, chosen, fallback):
            if codec.uses_context:
                # Its context may be stored another way now: the codec it extends, alone.
                standalone = getattr(codec, "standalone", None)
                codec = standalone() if standalone is not None else safe
            if codec.uses_reference:
                codecs.append(safe)
            elif codec.lossless:
                codecs.append(codec)
            else:
                # A lossy codec may be idempotent on its own output (a quantizer often is);
                # keep it only when this encode reproduces the tensor exactly.
                rebuilt = codec.encode(leaf.tensor).reconstruction
                exact = rebuilt is not None and same_bits(rebuilt, leaf.tensor)
                codecs.append(codec if exact else safe)
        return codecs

    def __repr__(self) -> str:
        return f"ExactRebasePolicy({self.inner!r})"


def rebase_step(storage: RunStorage, manifest: StepManifest, policy: Policy) -> StepManifest:
    """Rewrite a committed delta step as a full checkpoint; returns its new manifest.

    Order (crash-safe at every point): decode the step through its chain, write a new
    data file, publish the new manifest (the step is now full), then remove the old
    data file. A crash before the manifest leaves the old delta step intact; a failed
    manifest write removes the new data file again.
    """
    if manifest.kind == "full":
        return manifest
    state = load_step(storage, manifest.step)
    meta = {"step": manifest.step, "kind": "full", "base_step": None, "rebased": True}
    name, written = write_data(
        storage,
        manifest.step,
        lambda handle: write_state(handle, state, ExactRebasePolicy(policy), meta=meta),
    )
    try:
        rebased = publish_manifest(
            storage,
            replace(
                manifest,
                kind="full",
                base_step=None,
                data_file=name,
                data_bytes=written.stored_bytes,
                rebased=True,
            ),
        )
    except BaseException:
        _discard_unpublished(storage, manifest.step, name)
        raise
    storage.remove(manifest.data_file)
    return rebased


def _discard_unpublished(storage: RunStorage, step: int, data_file: str) -> None:
    """Remove the new data file of a re-base whose manifest write failed, unless the manifest
    landed anyway (an object store may apply a write whose reply was lost). The step keeps its
    old manifest and data either way. If this cleanup fails too, the file is an orphan that
    readers and ``verify_run`` ignore and the run's next save removes."""
    try:
        if read_manifest(storage, step).data_file != data_file:
            storage.remove(data_file)
    except Exception:  # noqa: BLE001 - cleanup after a failure must not mask it
        pass
