"""Integration: a scripts/build_big.py model directory served by a real TorchServe where it lies
(no .mar, no copy), and its table pages pushed out of memory between requests come back from
disk with the same scores."""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from dlrmkit.config import DLRMConfig
from dlrmkit.batch import collate, scores
from dlrmkit.forms import RequestParser
from dlrmkit.model import DLRMFactory
from scripts.tsctl import Server, post

pytestmark = pytest.mark.integration

REQUESTS = [
    (ROOT / "sample_requests" / name).read_bytes()
    for name in ("seed_single.json", "seed_multi_hot.json", "instances.json")
]
MADV_PAGEOUT = 21
SYS_PIDFD_OPEN, SYS_PROCESS_MADVISE = 434, 440  # x86_64 and aarch64 share these numbers


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def page_out(pid: int, path: Path) -> int:
    """Push the pages of ``path`` that ``pid`` maps out of memory (process_madvise MADV_PAGEOUT,
    then fadvise DONTNEED on the file); returns how many bytes of mappings were advised."""
    libc = ctypes.CDLL(None, use_errno=True)
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi - lo))
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    assert pidfd >= 0, os.strerror(ctypes.get_errno())
    try:
        iov = (IoVec * len(ranges))(*[IoVec(lo, n) for lo, n in ranges])
        done = libc.syscall(SYS_PROCESS_MADVISE, pidfd, iov, len(ranges), MADV_PAGEOUT, 0)
        assert done >= 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return sum(n for _, n in ranges)


def major_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from scripts import build_big

    tmp = tmp_path_factory.mktemp("ts-big")
    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc["handler"]["num_embeddings"] = [200_000, 1000, 1000]  # feature_0: 6.1 MiB of int8 rows
    doc.update(minWorkers=1, maxWorkers=1)
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    out = tmp / "store" / "big"
    build_big.main(["--config", str(cfg), "--dtype", "int8", "--out", str(out)])
    srv = Server.on_free_ports(tmp / "home", model_store=tmp / "store", overrides={"load_models": "big=big"})
    try:
        srv.start()
        srv.wait_ready("big", REQUESTS[0], timeout=240)
        yield srv, out
    finally:
        srv.stop()


def test_the_worker_maps_the_weights_where_they_lie(served):
    srv, out = served
    (pid,) = srv.worker_pids("big")
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert str(out / "dlrm.pt") in maps
    assert Path(os.readlink(f"/proc/{pid}/cwd")) == out
    # TorchServe's own directory for the model is a symbolic link to the model directory, not a copy
    (line,) = {ln for ln in (srv.log_dir / "ts_log.log").read_text().splitlines() if "createSymbolicDir" in ln}
    linked = Path(line.rsplit(" ", 1)[1])
    assert linked.is_symlink() and linked.resolve() == out, line


def test_scores_survive_the_tables_paged_out_between_requests(served):
    srv, out = served
    config = DLRMConfig.from_yaml(out / "model-config.yaml")
    model = DLRMFactory(config).load(out / "dlrm.pt")
    wants = [scores(model, collate([RequestParser(config).parse(raw)], config)[0], config)[0] for raw in REQUESTS]
    del model  # its mapping would share the pages: shared pages are not paged out
    gc.collect()
    (pid,) = srv.worker_pids("big")
    for raw, want in zip(REQUESTS, wants):
        got = []
        for _ in range(2):
            status, body, _ = post(f"{srv.url}/predictions/big", raw)
            assert status == 200, body
            got.append(json.loads(body)["scores"])
            assert page_out(pid, out / "dlrm.pt") > 0
        assert got[0] == got[1]
        assert max(abs(a - b) for a, b in zip(got[0], want)) < 1e-6, (got[0], want)
    faults = major_faults(pid)
    status, _, _ = post(f"{srv.url}/predictions/big", REQUESTS[0])
    assert status == 200 and major_faults(pid) > faults  # the rows came back from the file
