"""The activation-compression benchmark (``inshrink bench --activations``).

:func:`run_activation_bench` trains a CNN on sklearn's digits and a character transformer on
stdlib source under no compression, ``torch.utils.checkpoint``, ``save_on_cpu`` and
``compress_activations``, and reports activation memory (measured independently of the
codecs), peak RSS, step time and final quality. ``python -m inshrinkerator.activations.bench``
runs it from the command line.
"""

from .runner import run_activation_bench

__all__ = ["run_activation_bench"]
