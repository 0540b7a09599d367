"""Request builders shared by the tests."""

from __future__ import annotations

import json
import re
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def instance(dense, **bags) -> dict:
    """A seed-format instance: instance([..5 floats..], feature_0=[1, 2], feature_2=[7])."""
    return {
        "dense": list(dense),
        "sparse": {
            "keys": list(bags),
            "values": [i for ids in bags.values() for i in ids],
            "lengths": [len(ids) for ids in bags.values()],
        },
    }


def body(obj) -> bytes:
    return json.dumps(obj).encode()


DENSE = [0.5, -1.0, 0.25, 2.0, 0.0]


def wait_until(probe: Callable[[], T], done: Callable[[T], bool], timeout: float = 30.0, every: float = 0.2) -> T:
    """Call ``probe`` until ``done(result)`` or ``timeout`` s have passed; returns the last result,
    so the caller's assertion shows what was seen. Tests wait for what they check, never race it."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(every)


def scrape(srv, model: str = "dlrm") -> dict[str, float]:
    """dlrm_* samples of /metrics (Prometheus text, no token): {'name' or 'name[ErrorType]': value}."""
    from tsctl import get

    status, text, _ = get(f"{srv.metrics_url}/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        m = re.match(r'(dlrm_\w+)\{(?:ErrorType="(\w+)",)?ModelName="%s",Level="Model",Hostname="[^"]*",\} (\S+)$'
                     % re.escape(model), line)
        if m:
            out[m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")] = float(m.group(3))
    return out


def metrics_delta(srv, want: dict[str, float], before: dict[str, float], timeout: float = 30.0,
                  model: str = "dlrm") -> dict[str, float]:
    """The frontend reads the worker's metric lines asynchronously: poll until the counters have
    moved by at least ``want`` (bounded); the caller asserts exact values on the returned deltas."""
    def delta(now):
        return {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(want)}

    return delta(wait_until(lambda: scrape(srv, model),
                            lambda now: all(delta(now)[k] >= v for k, v in want.items()), timeout))


def settled(srv, timeout: float = 30.0, model: str = "dlrm") -> dict[str, float]:
    """The counters once earlier requests' metric lines have been read: no change in 0.5 s."""
    last = [scrape(srv, model)]

    def same(now):
        changed, last[0] = now != last[0], now
        return not changed

    return wait_until(lambda: scrape(srv, model), same, timeout, every=0.5)
