"""Drop-in checkpoint compression for the trainers people already run.

Each integration is its own module, imported only when asked for, so installing
inshrinkerator never pulls in a training framework:

- :mod:`inshrinkerator.integrations.lightning` — ``InkCheckpointIO`` (``pip install 'inshrinkerator[lightning]'``)
- :mod:`inshrinkerator.integrations.transformers` — ``InkTrainer`` / ``InkTrainerMixin``
  (``pip install 'inshrinkerator[transformers]'``)
- :mod:`inshrinkerator.integrations.dcp` — ``InkStorageWriter`` / ``InkStorageReader`` and the
  ``InkSavePlanner`` / ``InkLoadPlanner`` for ``torch.distributed.checkpoint`` (torch only)
"""

__all__: list[str] = []
