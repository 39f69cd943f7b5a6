"""Per-tensor choice between the error-bounded codecs.

``"quantizer"`` (torch ops, any device) and ``"sz3"`` (pysz, CPU float32/float64) both meet
the same absolute bound. With ``"auto"`` the chooser tries every applicable candidate on
a tensor the first time its slot is seen and again on every measuring step, keeps the
smallest (a slower candidate must be at least 5% smaller to win), and reuses that choice
for the slot in between (trying all of them every step would triple the packing time).
Tensors SZ3 cannot take (another device or dtype) always go to the quantizer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .quantizer import QuantizedActivation, quantize
from .sz3 import SZ3Activation, sz3_available, sz3_compress

__all__ = ["CodecChooser", "CODECS", "candidate_names"]

CODECS = ("auto", "quantizer", "sz3")
_INTERP_MIN_VALUES = 1 << 16  # spline prediction only pays off on large maps
_MARGIN = 0.95

Payload = Optional[object]
_Encoder = Callable[[torch.Tensor, float], "QuantizedActivation | SZ3Activation | None"]

_ENCODERS: dict[str, _Encoder] = {
    "quantizer": quantize,
    "sz3-nopred": lambda tensor, bound: sz3_compress(tensor, bound, "nopred"),
    "sz3-interp": lambda tensor, bound: sz3_compress(tensor, bound, "interp_lorenzo"),
}


def candidate_names(codec: str, tensor: torch.Tensor) -> list[str]:
    """The encoders worth trying for ``tensor`` under the ``codec`` setting, best guess first."""
    sz3_ok = (sz3_available() and tensor.device.type == "cpu"
              and tensor.dtype in (torch.float32, torch.float64))
    if codec == "quantizer" or not sz3_ok:
        return ["quantizer"]
    names = ["sz3-nopred"]
    if codec == "auto":
        names.append("quantizer")
    if tensor.numel() >= _INTERP_MIN_VALUES and tensor.dim() >= 2:
        names.append("sz3-interp")  # slowest: tried last, kept only when clearly smaller
    return names


class CodecChooser:
    """Encodes a tensor with the codec remembered for its slot, probing the candidates when asked."""

    def __init__(self, codec: str = "auto") -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown activation codec {codec!r}; expected one of {CODECS}")
        self.codec = codec
        self.chosen: dict[str, str] = {}

    def encode(self, tensor: torch.Tensor, error_bound: float, slot: str,
               probe: bool) -> tuple[Optional[object], str]:
        """(payload or None if no codec can meet the bound, name of the encoder used)."""
        names = candidate_names(self.codec, tensor)
        remembered = self.chosen.get(slot)
        if not probe and remembered in names:
            names = [remembered] + [n for n in names if n != remembered]
            payload = _ENCODERS[remembered](tensor, error_bound)
            if payload is not None:
                return payload, remembered
        best: Optional[object] = None
        best_name = "none"
        for name in names:
            payload = _ENCODERS[name](tensor, error_bound)
            # in speed order: a later (slower) candidate must be clearly smaller to win
            if payload is not None and (best is None or payload.nbytes < _MARGIN * best.nbytes):
                best, best_name = payload, name
        if best is not None:
            self.chosen[slot] = best_name
        return best, best_name
