"""Trained checkpoints in, the archive's state_dict out: what ``scripts/build_mar.py --checkpoint`` reads.

Accepted, with no code from the user:

- a ``.pt`` / ``.pth`` file of a state_dict, or of a dict holding one under ``model`` /
  ``model_state_dict`` / ``state_dict`` (optimizer state and the like are ignored, said in one line);
- a ``torch.distributed.checkpoint`` (DCP) directory (``.metadata`` + ``__<rank>_*.distcp``) from any
  number of ranks, read in this one process without a process group: each tensor is read straight
  into one preallocated full-size tensor, so the tables are never held twice;
- keys under any mix of the ``model.`` (``DLRMTrain``), ``module.`` / ``_dmp_wrapped_module.``
  (``DistributedModelParallel``, DDP) prefixes;
- tables named ``<feature>`` or ``t_<feature>`` (torchrec's examples), else ``handler.table_names``.

What a checkpoint does not record is never guessed where it changes the scores: the feature order
comes from the file (a state_dict keeps it), a numbered sequence or ``--feature-order``; the rest
(pooling, the dense features' order and preprocessing) is proven by ``verify_archive``
(``--verify``): the built archive loaded as a TorchServe worker loads it, scoring the trainer's own
requests against the trainer's own scores.

- ``read``: open a checkpoint, check it against the config (``plan_import``), read it
  (``import_checkpoint``);
- ``derive``: the config a checkpoint implies (``--write-config``);
- ``verify``: the built archive against the trainer's scores (``--verify``).

The archive names every table after its feature, so the handler's load path is the same for all.
No module here imports TorchServe: ``verify_archive`` runs the worker command its caller hands it
(``scripts/as_worker.py``).
"""

from dlrmkit.checkpoint.derive import config_text, derive_config, feature_order_of, numbered, write_config
from dlrmkit.checkpoint.read import (
    TABLES,
    Checkpoint,
    import_checkpoint,
    open_checkpoint,
    plan_import,
    say_ignored,
    table_for_features,
)
from dlrmkit.checkpoint.verify import Verified, read_verify_file, verify_archive

__all__ = [
    "TABLES",
    "Checkpoint",
    "Verified",
    "config_text",
    "derive_config",
    "feature_order_of",
    "import_checkpoint",
    "numbered",
    "open_checkpoint",
    "plan_import",
    "read_verify_file",
    "say_ignored",
    "table_for_features",
    "verify_archive",
    "write_config",
]
