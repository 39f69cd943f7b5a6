"""DynaQuant codecs that also decode with another tensor of the same file, their context:
``DynaQuantMaskedCodec`` and ``DynaQuantMaskedDeltaCodec`` code only the entries where the
context (a first moment, for its second moment) is non-zero; ``DynaQuantGroupedCodec``
codes its ids in one stream per octave of the context (a second moment, for its first
moment); ``SignGroupedResidualCodec`` codes a weight's change since the reference in one
id stream per sign of the context (its first moment). Their streams are
:class:`~.dynaquant.DynaQuantCodec`'s (see its module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from ..errors import FormatError
from .base import Codec, Encoded, TensorSpec
from .dynaquant import DynaQuantCodec, DynaQuantDeltaCodec
from .octave_groups import octave_groups, sign_groups
from .registry import register_codec
from .residual import ResidualCodec

__all__ = ["DynaQuantGroupedCodec", "DynaQuantMaskedCodec", "DynaQuantMaskedDeltaCodec", "SignGroupedResidualCodec"]


class _ContextKey:
    """The key of the tensor a codec also decodes with (its context), and its checks."""

    codec_id: str
    uses_context = True
    _context_key: Optional[str] = None

    @property
    def context_key(self) -> Optional[str]:
        """The formatted key path of the context tensor in the state (set when planned)."""
        return self._context_key

    def against(self, context_key: str) -> "Any":
        """This codec, planned to decode with the tensor at ``context_key``."""
        self._context_key = context_key
        return self

    def _context(self, spec: TensorSpec, context: Optional[torch.Tensor]) -> torch.Tensor:
        if context is None:
            raise FormatError(
                f"{self.codec_id}: this tensor is decoded with another tensor of the file, which was not given"
            )
        if context.numel() != spec.numel:
            raise FormatError(
                f"{self.codec_id}: the context tensor has {context.numel()} elements, this tensor {spec.numel}"
            )
        return context.detach().reshape(-1)


class _Contextual(_ContextKey):
    """A DynaQuant codec that also decodes with another tensor of the same file: its context.

    Subclasses say what the context tells ``_encode`` / ``_decode`` (:meth:`_context_options`)
    and which reference they take (:meth:`_own_reference`).
    """

    def standalone(self) -> "DynaQuantCodec":
        """The codec this one extends, without a context: same options and hints (for a
        tensor that must be stored on its own, e.g. when a delta step is rebased)."""
        base = next(cls for cls in type(self).__mro__[1:] if issubclass(cls, DynaQuantCodec) and not issubclass(cls, _Contextual))
        codec = base.from_config({**self.get_config(), "id": base.codec_id})  # type: ignore[attr-defined]
        codec._hints = dict(self._hints)  # type: ignore[attr-defined]
        return codec  # type: ignore[return-value]

    def _context_options(self, context: torch.Tensor, device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def _own_reference(self, spec: TensorSpec, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None

    def encode(
        self,
        tensor: torch.Tensor,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> Encoded:
        spec = TensorSpec.of(tensor)
        reference = self._own_reference(spec, reference)
        prepared = self._take_prepared(tensor, reference, context)  # type: ignore[attr-defined]
        if prepared is not None:
            return prepared
        options = self._context_options(self._context(spec, context), tensor.device)
        return self._encode(tensor, reference, **options)  # type: ignore[attr-defined]

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        options = self._context_options(self._context(spec, context), torch.device("cpu"))
        return self._decode(streams, spec, self._own_reference(spec, reference), **options)  # type: ignore[attr-defined]


@register_codec
class DynaQuantMaskedCodec(_Contextual, DynaQuantCodec):
    """:class:`DynaQuantCodec` for a tensor that is 0 wherever its *context* is 0.

    The context is another tensor of the same checkpoint (the writer and the reader hand
    over its reconstruction as ``context=``): Adam's first moment, whose pruned entries
    the second moment is pruned at too (ExCP's joint mask). Those entries are stored as 0
    and not coded at all: the mask costs no bytes. The stream is :class:`DynaQuantCodec`'s,
    its id stream holding the context's non-zero entries only, in order.
    """

    codec_id = "dynaquant_masked"

    def _context_options(self, context: torch.Tensor, device: torch.device) -> dict[str, Any]:
        return {"zeros": (context.cpu() == 0).to(device)}


@register_codec
class DynaQuantMaskedDeltaCodec(DynaQuantMaskedCodec, DynaQuantDeltaCodec):
    """:class:`DynaQuantMaskedCodec` with the kept entries' ids coded against the reference's
    predicted ids at the same positions (as :class:`DynaQuantDeltaCodec` codes them)."""

    codec_id = "dynaquant_masked_delta"

    def _own_reference(self, spec: TensorSpec, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return self._check_reference(spec, reference)


@register_codec
class DynaQuantGroupedCodec(_Contextual, DynaQuantCodec):
    """:class:`DynaQuantCodec` with its ids coded in one stream per octave of its *context*.

    The context is another tensor of the same checkpoint with the same number of
    elements (the writer and the reader hand over its reconstruction as ``context=``):
    Adam's second moment, for its first moment. ``|m|`` grows with ``sqrt(v)``, so the ids
    of the entries whose ``v`` shares an octave spread over fewer levels than the whole
    tensor's, and each group's own entropy coder pays less for them. The levels and the
    reconstruction are :class:`DynaQuantCodec`'s; the groups cost no bytes, since the
    decoder finds them from the context (:func:`octave_groups`).
    """

    codec_id = "dynaquant_grouped"

    def _context_options(self, context: torch.Tensor, device: torch.device) -> dict[str, Any]:
        return {"groups": octave_groups(context.to(device))}


@register_codec
class SignGroupedResidualCodec(_ContextKey, ResidualCodec):
    """:class:`~.residual.ResidualCodec` of a :class:`DynaQuantCodec` whose ids are coded in
    one stream per sign of its *context*: negative, zero, positive (:func:`sign_groups`).

    The context is another tensor of the same checkpoint with the same number of elements:
    Adam's first moment, for the change of its weight since the reference. Adam moves a
    weight by about ``-lr * m / sqrt(v)`` per step, so between close checkpoints most
    changes have the sign opposite to the stored first moment's, and each group's own
    entropy coder spends less on the changes' signs (MiniLM's fine-tune: 13.5 % fewer bytes
    for its weights' changes). The levels and the reconstruction are the residual's; the
    groups cost no bytes, since the decoder finds them from the context. The stream is the
    inner codec's, its ids in the layout of :class:`DynaQuantGroupedCodec`.
    """

    codec_id = "residual_sign_grouped"

    def __init__(self, inner: Union[dict[str, Any], Codec]) -> None:
        super().__init__(inner)
        if type(self._inner) is not DynaQuantCodec:
            raise ValueError(f"{self.codec_id}: the inner codec must be 'dynaquant', got {self.inner.get('id')!r}")

    def standalone(self) -> ResidualCodec:
        """The residual without a context (the same inner codec)."""
        return ResidualCodec(self._inner)

    def encode(
        self,
        tensor: torch.Tensor,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> Encoded:
        prepared = self._take_prepared(tensor, reference, context)
        if prepared is not None:
            return prepared
        groups = sign_groups(self._context(TensorSpec.of(tensor), context))
        inner: DynaQuantCodec = self._inner  # type: ignore[assignment]
        return self._encode_residual(tensor, reference, lambda residual: inner.encode_in_groups(residual, groups))

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        groups = sign_groups(self._context(spec, context))
        inner: DynaQuantCodec = self._inner  # type: ignore[assignment]
        return self._decode_residual(
            params, spec, reference, lambda _, residual_spec: inner.decode_in_groups(streams, residual_spec, groups)
        )
