"""Error-bounded compression of the activations saved for backward (COMET): less training memory.

``with inshrinkerator.compress_activations(model):`` keeps only compressed copies of the
tensors autograd saves between forward and backward. See ``docs/activations.md``.
"""

from .adaptive import AdaptiveErrorBound
from .hooks import ActivationCompressor, ActivationStatistics, SlotRecord, compress_activations
from .packed import PackedActivation
from .quantizer import QuantizedActivation, quantize
from .sz3 import SZ3Activation, sz3_available, sz3_compress

__all__ = [
    "compress_activations",
    "ActivationCompressor",
    "ActivationStatistics",
    "SlotRecord",
    "AdaptiveErrorBound",
    "PackedActivation",
    "QuantizedActivation",
    "quantize",
    "SZ3Activation",
    "sz3_compress",
    "sz3_available",
]
