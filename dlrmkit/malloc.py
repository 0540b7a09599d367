"""The worker's allocator: a forward's freed buffers kept for the next forward, not given back.

glibc's malloc gives freed memory back to the kernel: a buffer at or above its mmap threshold (128
KiB, raised as such buffers are freed, to 32 MiB at most) is unmapped when freed, and free space of
more than its trim threshold (twice the mmap threshold) at the heap's top is returned. A forward
allocates and frees the same multi-MB activations every time, so every forward faults them back in
and the kernel zeroes each page first: a served Criteo worker faulted ~1,700 pages for each 698-pair
query (docs/performance.md). ``keep_freed`` sets both thresholds once, at load: buffers up to 32
MiB come from the heap, and up to 1 GiB of free heap is kept. Measured on the Criteo config
(docs/performance.md, "A forward's memory kept"): ~0-3 faults a query, 4-8% less of the workers'
CPU per query and 0.87-0.96x the p99 under LoadGen, for 7-16 MB more of a worker's own memory.

An allocator setting the user made (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or ``GLIBC_TUNABLES``' glibc.malloc thresholds, read by
glibc at start) is left to decide; a libc other than glibc (musl) is left as it is. ``keep_freed``
says which, for the worker's log.

>>> class Libc:  # a glibc that takes every setting
...     def __init__(self): self.set = []
...     def gnu_get_libc_version(self): return b"2.36"
...     def mallopt(self, param, value): self.set.append((param, value)); return 1
>>> libc = Libc()
>>> keep_freed(libc, environ={})
'freed buffers kept for the next forward (glibc 2.36: mmap threshold 32 MiB, trim threshold 1024 MiB)'
>>> libc.set == [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30)]
True
>>> keep_freed(Libc(), environ={"MALLOC_TRIM_THRESHOLD_": "131072"})
'left as the environment sets it (MALLOC_TRIM_THRESHOLD_)'
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64 bits (DEFAULT_MMAP_THRESHOLD_MAX): larger buffers are
# always mapped, so a forward's few larger activations still fault (DLRMv2 at thousands of rows)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is returned: above any served forward's peak
# what the user may have set for glibc's malloc, read by glibc before any of this runs
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def set_by_user(environ: Mapping[str, str]) -> str | None:
    """The environment variable that already sets glibc's thresholds, if any."""
    for name in ENVIRONMENT:
        if name in environ:
            return name
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t in tunables for t in TUNABLES):
        return "GLIBC_TUNABLES"
    return None


def keep_freed(libc: Any = None, environ: Mapping[str, str] | None = None) -> str:
    """Set glibc's thresholds so freed buffers stay with the process (module docstring); returns
    what it did, as a phrase. ``libc``: the process's C library (default: the loaded one)."""
    env = os.environ if environ is None else environ
    user = set_by_user(env)
    if user:
        return f"left as the environment sets it ({user})"
    libc = ctypes.CDLL(None) if libc is None else libc
    version = getattr(libc, "gnu_get_libc_version", None)
    if version is None or not hasattr(libc, "mallopt"):
        return "left as it is (not glibc: no mallopt thresholds to set)"
    if isinstance(libc, ctypes.CDLL):
        version.restype = ctypes.c_char_p
    release = version().decode()
    for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if libc.mallopt(param, value) != 1:
            return f"not all kept (glibc {release} refused mallopt({param}, {value}))"
    return (
        f"freed buffers kept for the next forward (glibc {release}: mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
        f"trim threshold {TRIM_THRESHOLD >> 20} MiB)"
    )
