"""How many CPUs this process may really use, and how the kit splits them into workers and threads.

``os.cpu_count()`` is the machine's count: in a container it is the node's (64 on a 64-core
node), not the pod's CPU limit. The CPUs a process may use are its scheduler affinity
(``taskset``, cpusets) capped by its cgroup's CPU quota (a Kubernetes CPU limit becomes
``cpu.max`` on cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` on v1), rounded up: a
quota of 1.5 CPUs runs 2 threads, each throttled.

The rule (measured in results/cpu-rule.md, docs/performance.md): one single-threaded worker per
CPU. Imports nothing heavy: TorchServe's launcher (scripts/tsctl.py), the sizing scripts and the
handler all read it. ``PartsPool``: the threads one forward's parts run on, each on a CPU of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple


class Placement(NamedTuple):
    workers: int  # TorchServe workers of the model
    threads: int  # torch intra-op threads per worker


def available_cpus(
    root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup", affinity: set[int] | None = None
) -> int:
    """CPUs this process may use: its affinity, capped by the CPU quota of its cgroup and of every
    cgroup above it. ``root``, ``proc_cgroup`` and ``affinity`` are for tests (a fake cgroup tree).

    >>> # cpu.max "150000 100000" (1.5 CPUs), affinity {0..63}: 2
    """
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cpus = max(1, len(affinity))
    quota = cgroup_quota(Path(root), Path(proc_cgroup))
    return min(cpus, max(1, math.ceil(quota))) if quota is not None else cpus


def cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The smallest CPU quota (in CPUs) on the path from this process's cgroup up to ``root``,
    or None when there is none. In a container ``root`` is the container's own cgroup (its
    namespace shows it as "/"), so ``root/cpu.max`` is the pod's limit."""
    quotas = []
    for d, base, v2 in _cgroup_dirs(root, proc_cgroup):
        while True:
            q = _read_quota(d, v2)
            if q is not None:
                quotas.append(q)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[Path, Path, bool]]:
    """(directory, its hierarchy's top, is_v2) of this process's cgroups that can hold a CPU quota: the v2 one
    ("0::/path") and the v1 ``cpu`` controller's ("N:cpu,cpuacct:/path")."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            out.append((root / rel, root, True))
        elif "cpu" in controllers.split(","):
            base = next((root / n for n in (controllers, "cpu", "cpu,cpuacct") if (root / n).is_dir()), root / "cpu")
            out.append((base / rel, base, False))
    if not out:  # no /proc/self/cgroup: the top's own files
        out = [(root, root, True), (root / "cpu", root / "cpu", False)]
    return out


def _read_quota(d: Path, v2: bool) -> float | None:
    try:
        if v2:
            max_quota, period = (d / "cpu.max").read_text().split()[:2]
            return None if max_quota == "max" else int(max_quota) / int(period)
        quota = int((d / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def cpu_rule(cpus: int) -> Placement:
    """Workers and threads for ``cpus`` CPUs: one worker per CPU, one torch thread each.

    Measured on 1 and 2 CPUs (results/cpu-rule.md): on 2, 2 x 1 served 1.8-1.9x the ranking
    rows of 1 x 1 with a third of its p99, and more than 1 x 2; on 1, a second worker gained
    nothing. Workers share the memory-mapped tables, so a worker costs its process (~0.3 GB),
    not the tables; scripts/sizing.py checks the memory budget."""
    return Placement(max(1, cpus), 1)


def model_workers(max_workers: int | None, cpus: int, torch_threads: int = 0) -> int:
    """Worker processes of one model on ``cpus`` CPUs: the model config's ``maxWorkers`` when it
    pins them, else one per ``torch_threads`` CPUs when those are set (the KServe door's processes),
    else the rule's count.

    >>> model_workers(None, 4), model_workers(3, 4), model_workers(None, 4, torch_threads=2)
    (4, 3, 2)
    """
    if max_workers:
        return max(1, int(max_workers))
    if torch_threads:
        return max(1, cpus // torch_threads)
    return cpu_rule(cpus).workers


def torch_threads(configured: int, workers: int | None, cpus: int | None = None) -> int:
    """Intra-op threads for one worker: as configured (``handler.torch_threads``), else the
    worker's share of the CPUs (``workers`` None: the rule's count for these CPUs)."""
    if configured:
        return configured
    cpus = cpus or available_cpus()
    return max(1, cpus // (workers or cpu_rule(cpus).workers))


def split_parts(threads: int, cpus: int | None = None) -> int:
    """The most parts ``handler.split_rows`` runs one forward as: one per ``threads`` (each part's
    torch threads) of the CPUs this process may use, at least 1.

    >>> split_parts(1, cpus=2), split_parts(2, cpus=2), split_parts(1, cpus=1)
    (2, 1, 1)
    """
    return max(1, (cpus or available_cpus()) // max(1, threads))


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # no C library to ask: this_cpu says None
    _LIBC = None


def this_cpu() -> int | None:
    """The CPU the calling thread runs on now (the C library's ``sched_getcpu``; Python's ``os``
    has none), or None where it cannot say."""
    try:
        cpu = _LIBC.sched_getcpu()
    except (AttributeError, OSError):
        return None
    return cpu if cpu >= 0 else None


class PartsPool(ThreadPoolExecutor):
    """The threads a forward's later parts run on (``handler.split_rows``), while the calling
    thread runs the first: inside ``apart()`` the caller stays on the CPU it runs on and every task
    it submits runs on the pool's other CPUs (``cpus``: the worker's affinity by default).

    Left to the scheduler, a part's thread woken after the worker had idled was put on the
    caller's own CPU (Linux wakes a thread near its waker) and the two parts shared one CPU until
    the load balancer parted them: two halves of a 672-row DLRMv2 forward took 53-61 ms after
    0.2 s idle against 36-37 back to back; held apart, 38-39 (AMD EPYC, 2 vCPUs; by hand,
    docs/performance.md#both-cores-for-a-large-query). Only for single-threaded parts: a part
    with its own OpenMP team would start that team on the one CPU it was held to.

    >>> pool = PartsPool(1, cpus={0})   # one CPU: nothing to hold apart, tasks run as submitted
    >>> with pool.apart(): pool.submit(sum, [1, 2]).result()
    3
    >>> pool.shutdown()
    """

    def __init__(
        self, threads: int, name: str = "dlrm-split", initializer=None, initargs=(), cpus: Iterable[int] | None = None
    ):
        super().__init__(threads, name, initializer, initargs)
        self.cpus = frozenset(os.sched_getaffinity(0) if cpus is None else cpus)
        self._local = threading.local()  # per calling thread: the CPUs its tasks go to while apart

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """The calling thread held on its CPU and its tasks sent to the others, until the block ends
        (then the caller may run on all ``cpus`` again). Does nothing on one CPU or where the
        scheduler refuses (a sandbox without ``sched_setaffinity``)."""
        here = this_cpu()
        others = self.cpus - {here}
        if here is None or here not in self.cpus or not others:
            yield
            return
        try:
            os.sched_setaffinity(0, {here})
        except OSError:
            yield
            return
        self._local.others = others
        try:
            yield
        finally:
            self._local.others = None
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.cpus)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        others = getattr(self._local, "others", None)
        if others is None:
            return super().submit(fn, *args, **kwargs)
        return super().submit(_on, others, fn, *args, **kwargs)


def _on(cpus: frozenset[int], fn, *args, **kwargs):
    """``fn`` run on the calling thread once it may only use ``cpus`` (it stays so until moved again)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    return fn(*args, **kwargs)
