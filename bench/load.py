"""Closed-loop load: a small asyncio HTTP/1.1 client pool (keep-alive, loopback only, bounded).

Used by soak.py and faults.py (correctness under load) and common.measure_load (throughput and
latency); open-loop Server-scenario load is MLPerf's LoadGen (bench/mlperf.py). It reports
its own CPU time, since on a small machine it shares the cores with the server it measures.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlsplit

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TRANSPORT_ERROR, TIMEOUT = 0, -1  # LoadResult.events statuses besides HTTP codes


class Connection:
    """One keep-alive connection; reopens when the server closes it (TorchServe does after errors)."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.hostname not in LOOPBACK:
            raise ValueError(f"{url}: this load generator only targets loopback addresses")
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path or "/"
        self.reader = self.writer = None

    async def post(self, body: bytes, path: str | None = None) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            head = (
                f"POST {path or self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            try:
                self.writer.write(head + body)
                return await self._response()
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if attempt:  # a fresh connection failed too: the server is gone
                    raise
        raise AssertionError("unreachable")

    async def _response(self) -> tuple[int, bytes]:
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        length, close = 0, False
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        body = await self.reader.readexactly(length) if length else b""
        if close:
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.reader = self.writer = None


@dataclass
class LoadResult:
    sent: int = 0
    answered: int = 0
    transport_errors: int = 0  # connection refused or reset, twice in a row (see Connection.post)
    timeouts: int = 0  # no answer within ``deadline_s``: a hung client
    latencies_ms: list = field(default_factory=list)
    statuses: dict = field(default_factory=dict)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    # With ``record=True``: (sent, done, status) per request, perf_counter seconds; status is
    # the HTTP status, TRANSPORT_ERROR or TIMEOUT (faults.py reads recovery times from these).
    events: list = field(default_factory=list)

    def percentile(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    @classmethod
    def total(cls, results: list[LoadResult]) -> LoadResult:
        """Several runs as one: their counts, latencies, statuses and wall times summed."""
        out = cls(statuses=dict(sum((Counter(r.statuses) for r in results), Counter())))
        for name in ("sent", "answered", "transport_errors", "timeouts", "latencies_ms", "wall_s"):
            setattr(out, name, sum((getattr(r, name) for r in results), getattr(out, name)))
        return out


def percentile(data, q: float) -> float:
    """The q-th percentile (nearest rank) of ``data``; NaN when empty."""
    if not data:
        return float("nan")
    data = sorted(data)
    return data[min(len(data) - 1, int(q / 100 * len(data)))]


def p50_p99(data) -> list[float]:
    """The median and the 99th percentile of ``data`` (ms), to 0.1."""
    return [round(percentile(data, 50), 1), round(percentile(data, 99), 1)]


async def run_load(
    url: str,
    next_request: Callable[[int], tuple[bytes, Callable[[int, bytes], None] | None]],
    concurrency: int,
    duration_s: float,
    max_requests: int,
    progress: Callable[[LoadResult, float], Awaitable[None] | None] | None = None,
    deadline_s: float | None = None,
    record: bool = False,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """``concurrency`` clients, each sending one request at a time until ``duration_s``,
    ``max_requests`` or ``stop`` is set. ``next_request(i)`` returns the body and a check called
    with the answer. A request unanswered after ``deadline_s`` counts as a timeout (its
    connection is dropped)."""
    result = LoadResult()
    started = time.perf_counter()
    deadline = started + duration_s
    cpu0 = self_cpu()
    counter = iter(range(max_requests))

    async def client():
        conn = Connection(url)
        try:
            for i in counter:
                if time.perf_counter() >= deadline or (stop is not None and stop.is_set()):
                    break
                body, check = next_request(i)
                result.sent += 1
                t0 = time.perf_counter()
                try:
                    status, answer = await asyncio.wait_for(conn.post(body), deadline_s)
                except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                    hung = isinstance(e, TimeoutError)
                    if hung:
                        result.timeouts += 1
                        await conn.close()
                    else:
                        result.transport_errors += 1
                    if record:
                        result.events.append((t0, time.perf_counter(), TIMEOUT if hung else TRANSPORT_ERROR))
                    await asyncio.sleep(0.05)
                    continue
                if record:
                    result.events.append((t0, time.perf_counter(), status))
                result.latencies_ms.append((time.perf_counter() - t0) * 1000)
                result.answered += 1
                result.statuses[status] = result.statuses.get(status, 0) + 1
                if check:
                    check(status, answer)
        finally:
            await conn.close()

    async def reporter():
        while True:
            await asyncio.sleep(10)
            if progress:
                progress(result, time.perf_counter() - started)

    rep = asyncio.create_task(reporter())
    await asyncio.gather(*(client() for _ in range(concurrency)))
    rep.cancel()
    result.wall_s = time.perf_counter() - started
    result.client_cpu_s = self_cpu() - cpu0
    return result


def self_cpu() -> float:
    """User + system CPU seconds of this process: the load generator's share of the cores."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
