"""Raw Criteo TSV lines (handler.raw_input: criteo_tsv) against torchrec's own preprocessing:
random lines written to files, BinaryCriteoUtils.tsv_to_npys run on them, % num_embeddings;
the kit's transform must give exactly those rows, and the handler must score a raw line as the
same row sent as JSON."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch

from dlrmkit import criteo
from conftest import FakeContext
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import BadRequest, ConfigError
from dlrmkit.model import DLRMFactory

TSV = "text/tab-separated-values"
ROWS = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53] * 2  # 26 small tables, ids folded
CRITEO = {
    "num_dense_features": 13,
    "sparse_features": list(criteo.CAT_NAMES),
    "num_embeddings": ROWS[:26],
    "embedding_dim": 4,
    "dense_arch_layer_sizes": [8, 4],
    "over_arch_layer_sizes": [8, 1],
    "seed": 5,
    "id_overflow": "modulo",
    "max_instances_per_request": 64,
    "raw_input": "criteo_tsv",
    "dense_shift": 5,
}
MIN_DENSE = -3  # every file below holds it: tsv_to_npys then shifts by 2 - (-3) = 5


def criteo_line(rng: random.Random, label: bool) -> str:
    """A random line: missing fields, upper/lower-case hex, the training minimum, large counts."""
    dense = [
        rng.choice(["", "0", str(rng.randint(-3, 30)), str(MIN_DENSE), str(rng.randint(10**6, 2**31 - 10))])
        for _ in range(13)
    ]
    cat = [
        rng.choice(
            [
                "",
                format(rng.getrandbits(32), "08x"),
                format(rng.getrandbits(32), "08X"),
                format(rng.getrandbits(62), "x"),
                "0",
            ]
        )
        for _ in range(26)
    ]
    return "\t".join(([str(rng.randint(0, 1))] if label else []) + dense + cat)


def torchrec_rows(path: Path, dataset: str, rows: Sequence[int] = ROWS[:26]) -> tuple[np.ndarray, np.ndarray]:
    """torchrec's rows of a TSV file: (dense float32 [n, 13], ids % num_embeddings [n, 26])."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    out = [path.with_suffix(f".{k}.npy") for k in ("dense", "sparse", "labels")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's "local function is not supported by pickle"
        BinaryCriteoUtils.tsv_to_npys(str(path), *map(str, out), dataset_name=dataset)
    # InMemoryBinaryCriteoIterDataPipe(hashes=num_embeddings): sparse % hashes
    return np.load(out[0]), np.load(out[1]) % np.array(rows).reshape(1, 26)


def write_files(tmp: Path, n: int, seed: int = 0) -> list[tuple[Path, str, list[str]]]:
    """A labelled day file (criteo_1tb) and an unlabelled test file (criteo_kaggle test set)."""
    rng = random.Random(seed)
    files = []
    for name, label, dataset in (("day_0.tsv", True, "criteo_1tb"), ("kaggle_test.tsv", False, "criteo_kaggle")):
        lines = [criteo_line(rng, label) for _ in range(n)]
        lines[rng.randrange(n)] = "\t".join(([str(1)] if label else []) + [str(MIN_DENSE)] * 13 + ["a"] * 26)
        path = tmp / name
        path.write_text("\n".join(lines) + "\n")
        files.append((path, dataset, lines))
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("criteo"), 400)


def test_the_transform_is_torchrecs(files):
    for path, dataset, lines in files:
        dense, ids = torchrec_rows(path, dataset)
        shift, n = criteo.fit_dense_shift(path, chunk_bytes=4096)  # many chunks
        assert (shift, n) == (2 - MIN_DENSE, len(lines))
        parsed = criteo.parse("\n".join(lines).encode())
        ours, clipped = criteo.dense_features(parsed.dense, shift)
        assert clipped == 0 and ours.dtype == np.float32
        assert np.array_equal(ours, dense)  # bit for bit
        assert np.array_equal(parsed.ids % np.array(ROWS[:26]), ids)
        assert np.array_equal(criteo.read_file(path, chunk_bytes=1000).dense, parsed.dense)


def test_below_the_training_minimum_is_clipped_never_nan():
    raw = np.array([[-4, -100, -(2**31)] + [MIN_DENSE] * 10])
    dense, clipped = criteo.dense_features(raw, 2 - MIN_DENSE)
    assert clipped == 3 and np.isfinite(dense).all()
    assert np.array_equal(dense, np.full((1, 13), np.log(np.float32(2)), dtype=np.float32))


GOOD = "\t".join(["1"] * 13 + ["a"] * 26)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            GOOD + "\n" + GOOD + "\n" + "\t".join(["1"] * 13 + ["a"] * 7 + ["zz12"] + ["a"] * 18),
            "line 3, field 21 (cat_7): expected hex digits, got 'zz12'",
        ),
        (
            "0\t" + "\t".join(["1"] * 13 + ["a"] * 7 + ["-1f"] + ["a"] * 18),
            "line 1, field 22 (cat_7): expected hex digits, got '-1f'",
        ),
        (
            "\t".join(["1"] * 12 + ["a"] * 26),
            "line 1: expected 39 tab-separated fields (13 integers, 26 hex ids) or 40 (the label first), got 38",
        ),
        (
            GOOD + "\n\n" + GOOD,
            "line 2: expected 39 tab-separated fields (13 integers, 26 hex ids) or 40 (the label first), got 1",
        ),
        ("\t".join(["1.5"] + ["1"] * 12 + ["a"] * 26), "line 1, field 1 (int_0): expected an integer, got '1.5'"),
        (
            "\t".join(["1"] * 4 + ["2147483648"] + ["1"] * 8 + ["a"] * 26),
            "line 1, field 5 (int_4): expected an integer that fits int32 (torchrec's dense dtype), got '2147483648'",
        ),
        (
            "\t".join(["1"] * 13 + ["8000000000000000"] + ["a"] * 25),
            "line 1, field 14 (cat_0): expected a hex id that fits int64 (at most 7fffffffffffffff), got '8000000000000000'",
        ),
        ("\t".join(["1"] * 13 + ["a"] * 25 + ["é"]), "line 1, field 39 (cat_25): expected hex digits, got 'é'"),
        (
            "",
            "body: expected Criteo TSV lines (39 tab-separated fields, or 40 with the label first), got an empty body",
        ),
        (GOOD.encode() + b"\n1\t\xff", "line 2, field 2: expected UTF-8 text, got the invalid byte 0xff"),
    ],
)
def test_a_bad_line_is_named_by_line_and_field(body, message):
    with pytest.raises(BadRequest) as e:
        criteo.parse(criteo.to_bytes(body))
    assert e.value.message == message


def test_config_keys_are_checked():
    assert DLRMConfig.from_dict(CRITEO).raw.dense_shift == 5
    for change, message in [
        ({"dense_shift": None}, "handler.dense_shift: required with raw_input: criteo_tsv"),
        ({"raw_input": "csv"}, "handler.raw_input: expected one of criteo_tsv, got 'csv'"),
        ({"raw_input": None}, "handler.dense_shift: only used with raw_input: criteo_tsv"),
        ({"dense_shift": "3"}, "handler.dense_shift: expected a finite number, got '3'"),
        ({"num_dense_features": 12, "dense_arch_layer_sizes": [8, 4]}, "handler.raw_input: criteo_tsv needs"),
    ]:
        raw = {k: v for k, v in {**CRITEO, **change}.items() if v is not None}
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            DLRMConfig.from_dict(raw)


@pytest.fixture(scope="module")
def criteo_handler(tmp_path_factory):
    from dlrm_handler import TorchRecDLRMHandler

    tmp = tmp_path_factory.mktemp("criteo-handler")
    factory = DLRMFactory(DLRMConfig.from_dict(CRITEO))
    torch.save(factory.archive_state(factory.random()), tmp / "dlrm.pt")
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp, dict(CRITEO)))
    return h


def run(handler, bodies, content_types):
    ctx = FakeContext(Path("."), dict(CRITEO))
    ctx.headers = {i: {"Content-Type": t} for i, t in enumerate(content_types)}
    out = handler.handle([{"body": b} for b in bodies], ctx)
    handler.tally.flush()  # the batch's metrics into ctx now (the tally's thread would within 0.25 s)
    return out, ctx


def columns(dense: np.ndarray, ids: np.ndarray) -> str:
    """The rows as the JSON columns form (already-transformed features)."""
    return json.dumps(
        {
            "columns": {
                "dense": dense.tolist(),
                "sparse": {f: {"values": ids[:, j].tolist()} for j, f in enumerate(criteo.CAT_NAMES)},
            }
        }
    )


def test_a_raw_line_scores_as_its_json_row_and_bad_lines_fail_alone(criteo_handler, files):
    path, dataset, lines = files[0]
    dense, ids = torchrec_rows(path, dataset)
    bad = "\t".join(["1"] * 13 + ["a"] * 7 + ["zz12"] + ["a"] * 18)
    bodies = [
        "\n".join(lines[:10]),
        columns(dense[:10], ids[:10]),
        lines[10] + "\n" + bad,
        lines[11] + "\r\n",
        b"\xff\xfe",
        "",
        "\n".join(lines[:65]),
        files[1][2][0],
    ]
    out, ctx = run(criteo_handler, bodies, [TSV, "application/json", TSV, TSV + "; charset=utf-8", TSV, TSV, TSV, TSV])
    raw, as_json = json.loads(out[0])["scores"], json.loads(out[1])["scores"]
    assert len(raw) == 10 and max(abs(a - b) for a, b in zip(raw, as_json)) <= 1e-5
    assert ctx.statuses[2] == (400, "Bad Request")
    assert json.loads(out[2])["message"] == "line 2, field 21 (cat_7): expected hex digits, got 'zz12'"
    single = json.loads(out[3])
    assert 3 not in ctx.statuses and single["scores"] == [single["score"]]
    assert (
        abs(
            single["score"]
            - json.loads(run(criteo_handler, [columns(dense[11:12], ids[11:12])], ["application/json"])[0][0])["score"]
        )
        <= 1e-5
    )
    assert json.loads(out[4])["message"] == "line 1, field 1: expected UTF-8 text, got the invalid byte 0xff"
    assert json.loads(out[5])["message"].endswith("got an empty body")
    assert ctx.statuses[6][0] == 413 and json.loads(out[6])["message"] == (
        "body: at most 64 lines per request (handler.max_instances_per_request), got 65"
    )
    assert 7 not in ctx.statuses  # 39 fields: no label


def test_clipped_values_are_counted(criteo_handler):
    line = "\t".join(["-4", "-9"] + ["1"] * 11 + ["a"] * 26)
    out, ctx = run(criteo_handler, [line, line], [TSV, TSV])
    assert ctx.metrics.total("dlrm_clipped_dense_total") == 4
    assert json.loads(out[0])["score"] == json.loads(out[1])["score"]


def test_raw_lines_need_raw_input(handler):
    ctx = FakeContext(Path("."), None)
    ctx.headers = {0: {"Content-Type": TSV}}
    out = handler.handle([{"body": GOOD}], ctx)
    assert ctx.statuses[0][0] == 400
    assert "handler.raw_input is not set" in json.loads(out[0])["message"]
