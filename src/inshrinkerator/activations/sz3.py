"""SZ3 error-bounded compression of activations through the ``pysz`` package (CPU only).

SZ3 predicts each value (``NOPRED``: no prediction, best on small feature maps;
``INTERP_LORENZO``: spline/Lorenzo prediction, best on large smooth maps), quantizes the
residual into bins of width ``2 eb`` (so ``|x - x_hat| <= eb``), then Huffman + zstd codes
the bins. It works on float32/float64 arrays on the CPU.

A non-negative tensor with zeros (a ReLU output) is stored as a zero mask (1 bit per value,
zstd-packed) plus SZ3 of its non-zero values; decoding puts the zeros back exactly and
clamps every non-zero value to stay positive, which never increases the error (the true
value is positive). For signed tensors SZ3 keeps the bound but not the sign of values
within ``eb`` of zero; the quantizer codec keeps those.

Note: ``pysz.sz.compress`` returns a view into a buffer sized for the worst case (about 2x
the input); the bytes are copied out so that only the compressed size stays alive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import zstandard

from .bitpack import pack_mask, unpack_mask

__all__ = ["SZ3Activation", "sz3_compress", "sz3_available", "SZ3_PREDICTORS"]

SZ3_PREDICTORS = ("nopred", "interp_lorenzo")
_SUPPORTED = (torch.float32, torch.float64)

try:  # pysz is a declared dependency, but keep the quantizer usable if its wheel is missing
    from pysz import sz as _sz
    from pysz import szAlgorithm as _szAlgorithm
    from pysz import szConfig as _szConfig
    from pysz import szErrorBoundMode as _szErrorBoundMode
except ImportError:  # pragma: no cover - exercised only where pysz is absent
    _sz = None


def sz3_available() -> bool:
    """Whether the pysz package (SZ3) can be imported."""
    return _sz is not None


def _algorithm(predictor: str) -> int:
    return {"nopred": _szAlgorithm.NOPRED, "interp_lorenzo": _szAlgorithm.INTERP_LORENZO}[predictor]


@dataclass
class SZ3Activation:
    """SZ3 bytes of (the non-zero values of) a CPU tensor, plus the zero mask if one is kept."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    error_bound: float
    payload: np.ndarray  # uint8, exactly the compressed bytes
    values_shape: tuple[int, ...]  # what SZ3 compressed: the tensor's shape, or (nonzeros,)
    zero_mask: Optional[bytes]  # zstd of the packed (x != 0) bits, for non-negative tensors

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes) + (len(self.zero_mask) if self.zero_mask is not None else 0) + 48

    def decode(self) -> torch.Tensor:
        """The reconstruction, a CPU tensor of the original dtype and shape."""
        np_dtype = np.float32 if self.dtype == torch.float32 else np.float64
        values = torch.from_numpy(_sz.decompress(self.payload, np_dtype, self.values_shape)[0])
        if self.zero_mask is None:
            return values.reshape(self.shape)
        numel = math.prod(self.shape)
        packed = np.frombuffer(zstandard.ZstdDecompressor().decompress(self.zero_mask), dtype=np.uint8)
        nonzero = unpack_mask(torch.from_numpy(packed.copy()), numel)
        tiny = torch.finfo(self.dtype).tiny
        out = torch.zeros(numel, dtype=self.dtype)
        out.masked_scatter_(nonzero, values.reshape(-1).clamp_min(tiny))
        return out.view(self.shape)


def sz3_compress(tensor: torch.Tensor, error_bound: float,
                 predictor: str = "nopred") -> Optional[SZ3Activation]:
    """SZ3-compress a float32/float64 CPU tensor within ``error_bound`` (absolute).

    Returns ``None`` when SZ3 does not apply (pysz missing, another dtype or device,
    non-finite values, a bound that is not positive): the caller picks another codec.
    """
    if (_sz is None or tensor.dtype not in _SUPPORTED or tensor.device.type != "cpu"
            or not error_bound > 0 or not math.isfinite(error_bound) or tensor.numel() == 0):
        return None
    if predictor not in SZ3_PREDICTORS:
        raise ValueError(f"unknown SZ3 predictor {predictor!r}; expected one of {SZ3_PREDICTORS}")
    data = tensor.detach().contiguous()
    low, high = torch.aminmax(data)
    magnitude = max(abs(float(low)), abs(float(high)))
    if not math.isfinite(magnitude):
        return None
    # a bound near the dtype's resolution at this magnitude cannot be promised by rounding
    if error_bound < magnitude * torch.finfo(tensor.dtype).eps * 4:
        return None
    zero_mask = None
    values = data
    if float(low) >= 0:
        nonzero = data.reshape(-1) != 0
        if not bool(nonzero.all()):
            zero_mask = zstandard.ZstdCompressor(level=1).compress(pack_mask(nonzero).numpy().tobytes())
            values = torch.masked_select(data.reshape(-1), nonzero)
            if values.numel() == 0:
                values = data.reshape(-1)[:1]  # SZ3 needs one value; the mask zeroes it again
    config = _szConfig()
    config.errorBoundMode = _szErrorBoundMode.ABS
    config.absErrorBound = float(error_bound)
    config.cmprAlgo = _algorithm(predictor)
    array = values.numpy()
    compressed, _ratio = _sz.compress(array, config)
    payload = np.array(compressed, dtype=np.uint8, copy=True)  # drop the worst-case buffer
    return SZ3Activation(tuple(tensor.shape), tensor.dtype, float(error_bound), payload,
                         tuple(array.shape), zero_mask)
