"""Context groups: a context tensor's entries by the octave of their value (or by their
sign), in groups whose ids a DynaQuant codec codes as one stream each
(:class:`~.dynaquant_context.DynaQuantGroupedCodec`, :class:`~.residual.SignGroupedResidualCodec`)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ._numpy_paths import nonzero_positions, select, stable_argsort

__all__ = ["GROUP_MIN_ELEMENTS", "ContextGroups", "OctaveGroups", "SignGroups", "octave_groups", "sign_groups"]

#: A context octave group holds at least this many elements (the smallest octaves join the
#: next ones up; a short last group joins the one before): a group's stream header is a
#: few bytes, and an octave holding a handful of ids cannot pay for it.
GROUP_MIN_ELEMENTS = 1024


class ContextGroups:
    """A context's entries ordered by a key of their value (stably: by key, then position),
    cut into the groups whose ids are coded as one stream each: ``sizes`` are the groups'
    lengths, in order; :meth:`gather` takes a tensor's entries in that order and
    :meth:`scatter` puts them back."""

    sizes: list[int]

    def order(self) -> torch.Tensor:
        """Every flat position, in group order."""
        raise NotImplementedError

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (flat, one per context entry) in group order."""
        raise NotImplementedError

    def scatter(self, grouped: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`gather`: ``grouped`` written to the positions of ``out``."""
        raise NotImplementedError


class OctaveGroups(ContextGroups):
    """The entries of a context sorted (stably) by the octave of their value, cut into the
    groups whose ids are coded as one stream each (:func:`octave_groups`).

    ``sizes`` are the groups' lengths, in order. :meth:`gather` takes a tensor's entries in
    that order and :meth:`scatter` puts them back, without sorting all positions where one
    octave holds most of them (a sparse layer's second moment is mostly zeros): that
    octave's positions are one block of the order, in place, and only the others are
    sorted.
    """

    def __init__(self, octave: torch.Tensor, counts: list[int], sizes: list[int]) -> None:
        self.sizes = sizes
        self._numel = octave.numel()
        top = max(range(len(counts)), key=counts.__getitem__)
        self._top: Optional[torch.Tensor] = None  # the mask of the dominant octave's entries
        if 2 * counts[top] <= self._numel:
            self._sorted = stable_argsort(octave)  # every position, in order
            self._below = 0
        else:
            self._top = octave == top
            others = nonzero_positions(~self._top)
            self._sorted = others[stable_argsort(octave[others])]  # the others, in order
            self._below = sum(counts[:top])

    def order(self) -> torch.Tensor:
        """Every flat position, in group order."""
        if self._top is None:
            return self._sorted
        top = nonzero_positions(self._top)
        return torch.cat([self._sorted[: self._below], top, self._sorted[self._below :]])

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (flat, one per context entry) in group order."""
        sorted_ = self._sorted.to(values.device)
        if self._top is None:
            return values[sorted_]
        top = select(values, self._top.to(values.device))
        return torch.cat([values[sorted_[: self._below]], top, values[sorted_[self._below :]]])

    def scatter(self, grouped: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`gather`: ``grouped`` written to the positions of ``out``."""
        sorted_ = self._sorted.to(out.device)
        if self._top is None:
            out[sorted_] = grouped
            return out
        end = self._numel - (sorted_.numel() - self._below)
        out.masked_scatter_(self._top.to(out.device), grouped[self._below : end])
        out[sorted_] = torch.cat([grouped[: self._below], grouped[end:]])
        return out


def octave_groups(context: torch.Tensor) -> OctaveGroups:
    """The groups of ``context``'s entries by the octave of their value, ascending, each
    holding at least :data:`GROUP_MIN_ELEMENTS` (but a tensor with fewer entries: one group).

    The octave is the biased exponent of the value as a float32 (its bits 23-30): 0 for
    zeros and subnormals, 255 for infinities and NaN, one key per power of two between.
    Within a group the entries are ordered by octave, then by position. A pure function
    of the values, exact on any device, so encoder and decoder derive the same groups
    from the same reconstruction.
    """
    values = context.detach().reshape(-1)
    if values.dtype != torch.float32:
        values = values.float()
    bits = values.contiguous().view(torch.int32)
    octave = torch.bitwise_right_shift(bits, 23).bitwise_and_(255).to(torch.uint8)
    return _grouped(octave, 256)


class SignGroups(ContextGroups):
    """The entries of a context by its sign (:func:`sign_groups`): with three keys, the
    positions of each are found directly, without sorting them."""

    def __init__(self, positions: list[torch.Tensor], sizes: list[int]) -> None:
        self.sizes = sizes
        self._positions = positions  # of each key present, in key order

    def order(self) -> torch.Tensor:
        return torch.cat(self._positions) if self._positions else torch.empty(0, dtype=torch.int64)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        if not self._positions:
            return values[:0]
        return torch.cat([values.index_select(0, positions.to(values.device)) for positions in self._positions])

    def scatter(self, grouped: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        start = 0
        for positions in self._positions:
            out.index_copy_(0, positions.to(out.device), grouped[start : start + positions.numel()])
            start += positions.numel()
        return out


def sign_groups(context: torch.Tensor) -> SignGroups:
    """The groups of ``context``'s entries by their sign: negative, zero, positive (by the
    sign bit of the value as a float32: -0.0 is zero, a NaN goes with its sign bit), each
    holding at least :data:`GROUP_MIN_ELEMENTS` as in :func:`octave_groups` (a small group
    joins the next one). Exact on any device, like :func:`octave_groups`."""
    values = context.detach().reshape(-1)
    if values.dtype != torch.float32:
        values = values.float()
    bits = values.contiguous().view(torch.int32)
    if bits.device.type == "cpu":  # NumPy: 1.0 ms where torch took 4.9 (590K values, one thread)
        raw = bits.numpy()
        negative, zero = raw < 0, (raw & 0x7FFFFFFF) == 0
        masks = [negative & ~zero, zero, ~(negative | zero)]
        positions = [torch.from_numpy(np.flatnonzero(mask).astype(np.int64, copy=False)) for mask in masks]
    else:
        negative, zero = bits < 0, (bits & 0x7FFFFFFF) == 0
        masks = [negative & ~zero, zero, ~(negative | zero)]
        positions = [torch.nonzero(mask).reshape(-1) for mask in masks]
    sizes = _group_sizes([where.numel() for where in positions])
    return SignGroups([where for where in positions if where.numel()], sizes)


def _grouped(key: torch.Tensor, keys: int) -> OctaveGroups:
    # The groups of entries by ``key`` (uint8 below ``keys``), ascending.
    counts = torch.bincount(key, minlength=keys).tolist()
    return OctaveGroups(key, counts, _group_sizes(counts))


def _group_sizes(counts: list[int]) -> list[int]:
    # Consecutive keys' counts joined into groups of at least GROUP_MIN_ELEMENTS (a short
    # last group joins the one before; fewer entries in all: one group).
    sizes: list[int] = []
    pending = 0
    for count in counts:
        pending += count
        if pending >= GROUP_MIN_ELEMENTS:
            sizes.append(pending)
            pending = 0
    if pending:
        if sizes:
            sizes[-1] += pending
        else:
            sizes.append(pending)
    return sizes
