"""Test only: the kit's TorchServe handler with live updates applied WITHOUT the lock
(tests/unguarded.py), for tests/test_delta_server.py's proof that its torn-score check catches a
torn apply. Shipped in that test's archive beside dlrm_handler.py and unguarded.py; TorchServe
wants exactly one class in a handler file."""

from dlrm_handler import TorchRecDLRMHandler
from unguarded import UnguardedApplier


class UnguardedHandler(TorchRecDLRMHandler):
    delta_applier = UnguardedApplier
