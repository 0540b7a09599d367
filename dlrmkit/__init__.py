"""The DLRM serving kit's TorchServe-free modules. dlrm_handler.py stays at the archive's root
(TorchServe loads it from there) and imports these.

A request's way (docs/development.md draws it)::

    protocols  open_request: the request's protocol; its parse / answer / error
    forms      the /predictions JSON forms (RequestParser), decoded by schema (msgspec)
    criteo     Criteo TSV lines: the one transform training and serving share
    request    ParsedRequest: what every protocol parses into
    batch      collate (dense [B, F_dense] + one KeyedJaggedTensor) and scores (one forward)
    errors     the error types, each with its HTTP status

and the model's side: config (DLRMConfig, validated), model (DLRMFactory), scale (quantized, mmap'd, sharded tables),
checkpoint (trained checkpoints in, built archives proven), accuracy (the AUC and the accuracy contract),
cpus (workers and threads per CPU).
"""
