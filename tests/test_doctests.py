"""The examples in the kit's and bench's docstrings run and print what they say (doctest): an
example that drifted from the code fails here rather than misleading a reader."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WITH_EXAMPLES = sorted(
    p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    for folder in ("dlrmkit", "bench")
    for p in (ROOT / folder).rglob("*.py")
    if ">>> " in p.read_text()
)


def test_the_examples_are_found():
    assert {"dlrmkit.batch", "dlrmkit.cpus", "dlrmkit.malloc", "dlrmkit.model"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_examples_run(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples read the repository's model configs by relative path
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result.failed} of {result.attempted} failed"
