"""The CPU-count rule: affinity capped by the cgroup CPU quota (fake cgroup trees, v2 and v1),
never os.cpu_count(); workers and threads derived from it."""

from __future__ import annotations

import os

import pytest

from dlrmkit.cpus import PartsPool, Placement, available_cpus, cpu_rule, this_cpu, torch_threads


def tree(tmp_path, proc: str, files: dict[str, str]):
    """A fake /sys/fs/cgroup (``files``: path -> text) and a fake /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc-cgroup").write_text(proc)
    return {"root": root, "proc_cgroup": tmp_path / "proc-cgroup"}


def test_v2_quota_caps_the_affinity_rounded_up(tmp_path):
    fake = tree(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert available_cpus(**fake, affinity=set(range(64))) == 2  # a 1.5-CPU limit on a 64-core node
    assert available_cpus(**fake, affinity={3}) == 1  # the affinity is smaller


def test_v2_no_quota_is_the_affinity(tmp_path):
    fake = tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert available_cpus(**fake, affinity={0, 1, 2, 5}) == 4


def test_v2_nested_cgroup_takes_the_smallest_quota_on_the_path(tmp_path):
    fake = tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "800000 100000",
            "kubepods/pod1/cpu.max": "300000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
        },
    )
    assert available_cpus(**fake, affinity=set(range(16))) == 3


def test_v1_cfs_quota(tmp_path):
    fake = tree(
        tmp_path,
        "12:cpu,cpuacct:/docker/abc\n0::/\n",
        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"},
    )
    assert available_cpus(**fake, affinity=set(range(32))) == 2
    unlimited = tree(tmp_path / "u", "4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert available_cpus(**unlimited, affinity=set(range(32))) == 32


def test_no_cgroup_files_is_the_affinity(tmp_path):
    fake = tree(tmp_path, "0::/\n", {})
    assert available_cpus(**fake, affinity={0, 1}) == 2


def test_this_process_affinity_not_cpu_count(monkeypatch):
    """The real call follows sched_setaffinity (taskset), whatever os.cpu_count() says."""
    before = os.sched_getaffinity(0)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert available_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert available_cpus() <= len(before)


@pytest.mark.parametrize("cpus, placement", [(1, Placement(1, 1)), (2, Placement(2, 1)), (16, Placement(16, 1))])
def test_one_single_threaded_worker_per_cpu(cpus, placement):
    assert cpu_rule(cpus) == placement


def test_torch_threads_share_the_cpus_among_the_workers():
    assert torch_threads(3, 1, cpus=2) == 3  # configured wins
    assert torch_threads(0, None, cpus=2) == 1  # the rule's 2 workers
    assert torch_threads(0, 1, cpus=2) == 2  # maxWorkers pinned to 1: the worker takes both
    assert torch_threads(0, 4, cpus=16) == 4
    assert torch_threads(0, 32, cpus=16) == 1


def test_parts_pool_holds_the_caller_on_its_cpu_and_runs_tasks_on_the_others():
    """Inside apart() the calling thread may only run on the CPU it was on and a submitted task
    only on the pool's other CPUs; after it the caller has all of them back. On a single CPU (or
    a pool of one) nothing is held."""
    mine = frozenset(os.sched_getaffinity(0))
    pool = PartsPool(1)
    try:
        assert pool.cpus == mine
        with pool.apart():
            held = frozenset(os.sched_getaffinity(0))
            task = pool.submit(os.sched_getaffinity, 0).result()
        after = frozenset(os.sched_getaffinity(0))
        outside = pool.submit(sum, [2, 3]).result()  # outside apart(): as a ThreadPoolExecutor
    finally:
        pool.shutdown()
        os.sched_setaffinity(0, mine)
    assert after == mine and outside == 5
    if len(mine) > 1:
        (here,) = held
        assert here in mine and task == mine - {here}
    else:
        assert held == mine and task == mine


def test_this_cpu_is_one_the_thread_may_run_on():
    assert this_cpu() in os.sched_getaffinity(0)
