"""The network-facing parsers under fuzzing (scripts/fuzz.py): the inputs the campaign found
replayed against the invariant, their exact answers, and a short seeded atheris run of every
target (the long campaign's figures: results/2026-12-02-fuzz/fuzz.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

from scripts import fuzz  # noqa: E402

FOUND = sorted((ROOT / "tests" / "fuzz").glob("*/*"))


@pytest.mark.parametrize("path", FOUND, ids=[f"{p.parent.name}/{p.name}" for p in FOUND])
def test_found_input_parses_or_is_refused_naming_a_field(path: Path):
    fuzz.Harness(path.parent.name).check(path.read_bytes())


@pytest.mark.parametrize(
    "target, body, message",
    [
        ("json", b'{"": 1}', 'body: unknown field ""; expected dense, sparse,'),
        ("json", b'{"instances": [{"": 1}]}', 'instances[0]: unknown field ""; expected dense,'),
        ("json", b'{"sparse": {"": 1}}', 'sparse: unknown field ""; expected keys, values, lengths'),
        ("json", b'{"a`b": 1}', 'body: unknown field "a`b"; expected dense,'),
        ("json", b'{"dnese": 1}', "dnese: unknown field; expected dense,"),
        ("kserve_v1", b'{"instances": [], ": []": 1}', 'body: unknown field ": []"; expected dense,'),
        (
            "oip_json",
            (ROOT / "tests/fuzz/oip_json/empty-input-name.json").read_bytes(),
            'inputs[1].name: expected the name of an input, got ""',
        ),
    ],
)
def test_what_fuzzing_found_is_answered_400_naming_the_field(target, body, message):
    from dlrmkit.errors import BadRequest

    harness = fuzz.Harness(target)
    for req in harness.requests(body):  # bytes and, as TorchServe may hand it over, decoded
        with pytest.raises(BadRequest) as e:
            req.parse()
        assert e.value.status == 400 and e.value.message.startswith(message), e.value.message
        assert json.loads(req.error(e.value).body)


def test_a_broken_invariant_is_caught():
    """The check itself: a parser that lets a non-4xx error out fails it."""
    harness = fuzz.Harness("json")

    class Broken:
        def parse(self):
            raise KeyError("feature_0")

    with pytest.raises(KeyError):
        harness._check(Broken())
    with pytest.raises(AssertionError, match="names no field"):
        from dlrmkit.errors import BadRequest

        fuzz._refusal(BadRequest(": unknown field"))


def test_every_target_survives_a_short_seeded_atheris_run():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), "smoke", "--seconds", "3", "--runs", "1000"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.count("exit 0") == len(fuzz.TARGETS), out.stdout


def test_oip_v2_json_decoded_by_torchserve_scores_as_its_bytes():
    """TorchServe's default decode_input_request=true hands an application/json body over as a
    dict: a v2 request so decoded was refused (inputs[0].data: expected `raw`), found while
    fuzzing both forms; now it scores as its bytes do."""
    from dlrmkit.batch import collate, scores

    harness = fuzz.Harness("oip_json")
    body = json.dumps({"inputs": fuzz._v2_inputs()}).encode()
    as_bytes, as_dict = list(harness.requests(body))
    got = [scores(harness.model, collate([r.parse()], harness.config)[0], harness.config) for r in (as_bytes, as_dict)]
    assert got[0] == got[1] and len(got[0][0]) == 2
    assert json.loads(as_dict.answer(got[1][0]).body)["outputs"][0]["data"] == got[0][0]
