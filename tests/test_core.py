"""The TorchServe-free core: request forms, the batch's KJT layout, scores vs a direct model call."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import tiny_config
from dlrmkit.batch import collate, scores
from dlrmkit.forms import RequestParser, response_body
from helpers import DENSE, body, instance


@pytest.fixture
def parser(config):
    return RequestParser(config)


def run(parser, model, config, bodies):
    parsed = [parser.parse(b) for b in bodies]
    batch, errors = collate(parsed, config)
    assert errors == {}
    return scores(model, batch, config)


def direct(model, dense_rows, lengths, values):
    """The model on hand-built tensors (key-major lengths), as probabilities."""
    kjt = KeyedJaggedTensor(
        keys=["feature_0", "feature_1", "feature_2"],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )
    with torch.inference_mode():
        return torch.sigmoid(model(torch.tensor(dense_rows, dtype=torch.float32), kjt)).squeeze(1).tolist()


def test_seed_form_in_any_key_order_matches_direct_model_call(parser, model, config):
    a = body(instance(DENSE, feature_0=[1, 2], feature_1=[3], feature_2=[4, 5, 6]))
    b = body(instance(DENSE, feature_2=[4, 5, 6], feature_0=[1, 2], feature_1=[3]))
    want = direct(model, [DENSE], [2, 1, 3], [1, 2, 3, 4, 5, 6])
    assert run(parser, model, config, [a])[0] == pytest.approx(want, abs=1e-6)
    assert run(parser, model, config, [b])[0] == pytest.approx(want, abs=1e-6)


def test_kjt_layout_is_key_major_with_omitted_keys_as_empty_bags(parser, config):
    reqs = [
        body(instance(DENSE, feature_1=[7], feature_0=[3, 4])),  # row 0
        body({"instances": [instance([1] * 5, feature_2=[9, 8]), instance([2] * 5, feature_0=[5])]}),  # rows 1, 2
        body(instance([3] * 5)),  # row 3: no ids at all
    ]
    batch, errors = collate([parser.parse(r) for r in reqs], config)
    assert errors == {}
    assert batch.rows == [1, 2, 1]
    kjt = batch.sparse
    assert kjt.keys() == ["feature_0", "feature_1", "feature_2"]
    #                      feature_0     feature_1     feature_2
    assert kjt.lengths().tolist() == [2, 0, 1, 0, 1, 0, 0, 0, 0, 2, 0, 0]
    assert kjt.values().tolist() == [3, 4, 5, 7, 9, 8]
    assert kjt.values().dtype == torch.int64
    assert batch.dense.dtype == torch.float32
    assert batch.dense.tolist() == [DENSE, [1.0] * 5, [2.0] * 5, [3.0] * 5]


def test_batch_matches_direct_model_call_on_same_tensors(parser, model, config):
    reqs = [
        body(instance(DENSE, feature_1=[7], feature_0=[3, 4])),
        body({"instances": [instance([1] * 5, feature_2=[9, 8]), instance([2] * 5, feature_0=[5])]}),
    ]
    got = run(parser, model, config, reqs)
    want = direct(model, [DENSE, [1] * 5, [2] * 5], [2, 0, 1, 1, 0, 0, 0, 2, 0], [3, 4, 5, 7, 9, 8])
    assert got[0] == pytest.approx(want[:1], abs=1e-6)
    assert got[1] == pytest.approx(want[1:], abs=1e-6)


def test_scores_are_batch_invariant(parser, model, config):
    reqs = [
        body(instance(DENSE, feature_0=[1], feature_1=[2], feature_2=[3])),
        body(instance([0.1] * 5, feature_2=[39, 0, 17, 17])),
        body({"instances": [instance([1, 2, 3, 4, 5], feature_1=[29]), instance([-1] * 5)]}),
        body(instance([9, 8, 7, 6, 5], feature_0=[19, 18], feature_1=list(range(10)))),
    ]
    solo = [run(parser, model, config, [r])[0] for r in reqs]
    together = run(parser, model, config, reqs)
    reversed_ = run(parser, model, config, reqs[::-1])[::-1]
    for s, t, r in zip(solo, together, reversed_):
        assert torch.allclose(torch.tensor(s), torch.tensor(t), atol=1e-5)
        assert torch.allclose(torch.tensor(s), torch.tensor(r), atol=1e-5)
    # an instances list scores each instance as it would alone
    alone = [run(parser, model, config, [body(i)])[0][0] for i in json.loads(reqs[2])["instances"]]
    assert torch.allclose(torch.tensor(alone), torch.tensor(together[2]), atol=1e-5)


def test_every_input_moves_the_score(parser, model, config):
    base = run(parser, model, config, [body(instance(DENSE, feature_0=[1], feature_1=[2], feature_2=[3]))])[0][0]
    variants = [
        instance(DENSE, feature_0=[2], feature_1=[2], feature_2=[3]),
        instance(DENSE, feature_0=[1], feature_1=[5], feature_2=[3]),
        instance(DENSE, feature_0=[1], feature_1=[2], feature_2=[30]),
        instance(DENSE, feature_0=[1, 1], feature_1=[2], feature_2=[3]),  # multi-hot
        instance(DENSE, feature_1=[2], feature_2=[3]),  # omitted key
        instance([5, -1.0, 0.25, 2.0, 0.0], feature_0=[1], feature_1=[2], feature_2=[3]),
    ]
    for v in variants:
        moved = run(parser, model, config, [body(v)])[0][0]
        assert abs(moved - base) > 1e-3, v
    assert 0.02 < base < 0.98  # away from the sigmoid's flat ends


def test_criteo_format_is_lengths_in_model_order(parser, model, config):
    criteo = {"float_features": DENSE, "id_list_features.lengths": [2, 0, 1], "id_list_features.values": [4, 5, 6]}
    seed = instance(DENSE, feature_0=[4, 5], feature_2=[6])
    assert run(parser, model, config, [body(criteo)]) == run(parser, model, config, [body(seed)])


def test_dict_str_and_bytes_bodies_parse_alike(parser, model, config):
    obj = instance(DENSE, feature_0=[1], feature_2=[3])
    forms = [obj, json.dumps(obj), json.dumps(obj).encode(), bytearray(json.dumps(obj).encode())]
    results = [run(parser, model, config, [f]) for f in forms]
    assert all(r == results[0] for r in results)


def test_logit_output_is_the_raw_logit(model):
    cfg = tiny_config(output="logit")
    p = RequestParser(cfg)
    logit = run(p, model, cfg, [body(instance(DENSE, feature_0=[1]))])[0][0]
    prob = run(RequestParser(tiny_config()), model, tiny_config(), [body(instance(DENSE, feature_0=[1]))])[0][0]
    assert torch.sigmoid(torch.tensor(logit)).item() == pytest.approx(prob, abs=1e-6)


def test_modulo_folds_out_of_range_ids_and_counts_them(model):
    cfg = tiny_config(id_overflow="modulo")
    p = RequestParser(cfg)
    batch, errors = collate([p.parse(body(instance(DENSE, feature_0=[21, 3], feature_2=[85])))], cfg)
    assert errors == {}
    assert batch.sparse.values().tolist() == [1, 3, 5]  # 21 % 20, 3, 85 % 40
    assert batch.remapped_ids == 2
    folded = scores(model, batch, cfg)
    assert folded == run(p, model, cfg, [body(instance(DENSE, feature_0=[1, 3], feature_2=[5]))])


def test_response_body_shape():
    assert json.loads(response_body([0.25])) == {"score": 0.25, "scores": [0.25]}
    assert json.loads(response_body([0.25, 0.5])) == {"scores": [0.25, 0.5]}


def columns(dense, **bags):
    """ParsedRequest.columnar from plain lists: columns([[..5..], [..5..]], feature_0=([2, 1], [3, 4, 5]))."""
    from dlrmkit.request import ParsedRequest

    idx = {"feature_0": 0, "feature_1": 1, "feature_2": 2}
    return ParsedRequest.columnar(
        np.array(dense, dtype=np.float32),
        {
            idx[k]: (np.array(lengths, dtype=np.int64), np.array(values, dtype=np.int64))
            for k, (lengths, values) in bags.items()
        },
        {idx[k]: (f"{k}.lengths", f"{k}.values") for k in bags},
    )


def test_columnar_rows_score_like_the_same_instances_in_one_batch(parser, model, config):
    rows = [instance(DENSE, feature_0=[3, 4], feature_1=[7]), instance([1] * 5, feature_0=[5], feature_2=[9, 8])]
    col = columns([DENSE, [1] * 5], feature_1=([1, 0], [7]), feature_0=([2, 1], [3, 4, 5]), feature_2=([0, 2], [9, 8]))
    single = body(instance([2] * 5, feature_2=[1]))
    batch, errors = collate([parser.parse(single), col, parser.parse(body({"instances": rows}))], config)
    assert errors == {} and batch.rows == [1, 2, 2]
    got = scores(model, batch, config)
    assert got[1] == pytest.approx(got[2], abs=1e-6)
    assert got[0] == pytest.approx(run(parser, model, config, [single])[0], abs=1e-6)


@pytest.mark.parametrize(
    "bags,message",
    [
        ({"feature_0": ([1], [3])}, "feature_0.lengths: expected one length per row (2), got shape [1]"),
        ({"feature_0": ([1, -1], [3])}, "feature_0.lengths[1]: expected a non-negative integer, got -1"),
        ({"feature_0": ([1, 1], [3])}, "feature_0.values: expected sum(feature_0.lengths) = 2 ids, got shape [1]"),
        ({"feature_0": ([1, 1], [3, -2])}, "feature_0.values[1]: expected a non-negative integer, got -2"),
    ],
)
def test_columnar_rejections_name_the_field(bags, message):
    from dlrmkit.errors import BadRequest

    with pytest.raises(BadRequest) as info:
        columns([DENSE, DENSE], **bags)
    assert info.value.message == message


def test_columnar_out_of_range_id_names_its_position(config):
    col = columns([DENSE, DENSE], feature_1=([1, 1], [2, 3]), feature_2=([0, 2], [1, 40]))
    batch, errors = collate([col], config)
    assert batch is None
    assert errors[0].message.startswith("feature_2.values[1]: id 40 is out of range for feature 'feature_2'")
    hot = columns([DENSE, DENSE], feature_2=([1, 1], [3, 40]), feature_0=([1, 1], [1, 2]))  # single-hot
    assert hot.onehot is not None and hot.onehot[0] == (0, 2)
    batch, errors = collate([hot], config)
    assert batch is None
    assert errors[0].message.startswith("feature_2.values[1]: id 40 is out of range for feature 'feature_2'")


# --- the ranking form: {"context": {...}, "candidates": [...]} ---------------------------------


def test_ranking_form_scores_exactly_as_the_same_instances(parser, model, config):
    """Each candidate's row is the context plus its own features: the same KJT, so the same
    scores bit for bit, whether the candidates share one key list (the vectorised path) or not."""
    ctx = {"dense": DENSE, "sparse": {"keys": ["feature_2"], "values": [5, 6], "lengths": [2]}}
    shared = [
        {"sparse": {"keys": ["feature_1", "feature_0"], "values": [i, 2 * i, i + 1], "lengths": [1, 2]}}
        for i in range(6)
    ]
    mixed = shared[:2] + [{"sparse": {"keys": ["feature_0"], "values": [9], "lengths": [1]}}, {}]
    for cands in (shared, mixed):
        rows = []
        for c in cands:
            s = c.get("sparse", {"keys": [], "values": [], "lengths": []})
            rows.append(
                {
                    "dense": DENSE,
                    "sparse": {
                        "keys": s["keys"] + ["feature_2"],
                        "values": s["values"] + [5, 6],
                        "lengths": s["lengths"] + [2],
                    },
                }
            )
        want = run(parser, model, config, [body({"instances": rows})])[0]
        got = run(parser, model, config, [body({"context": ctx, "candidates": cands})])[0]
        assert got == want and len(set(got)) == len(set(map(json.dumps, cands)))


def test_ranking_form_with_dense_per_candidate_and_in_a_mixed_batch(parser, model, config):
    cands = [
        {"dense": [float(i)] * 5, "sparse": {"keys": ["feature_0"], "values": [i], "lengths": [1]}} for i in range(3)
    ]
    ctx = {"sparse": {"keys": ["feature_1"], "values": [4], "lengths": [1]}}
    rows = [instance(c["dense"], feature_0=[i], feature_1=[4]) for i, c in enumerate(cands)]
    single = body(instance(DENSE, feature_2=[1]))
    got = run(parser, model, config, [single, body({"context": ctx, "candidates": cands}), single])
    assert got == run(parser, model, config, [single, body({"instances": rows}), single])  # same batch: exact
    # The same row at two places in one batch: equal to float rounding, not bit for bit on every
    # CPU (AVX-512/AMX GEMM kernels round a batch's rows by position); a misrouted answer would
    # be another row's score, far beyond this.
    assert got[0] == pytest.approx(got[2], abs=1e-6) and len(got[1]) == 3


# --- the columns form: {"columns": {"dense": [[...], ...], "sparse": {"<feature>": {...}}}} ------


def test_columns_form_scores_exactly_as_the_same_instances(parser, model, config):
    """Feature by feature, in any order, with lengths or single-hot (lengths left out), alone
    or beside a context: the same KJT as the rows, so the same scores bit for bit."""
    dense = [[i / 3, -i, 0.5, 1.0, i * 0.25] for i in range(4)]
    bags0 = [[], [1, 2], [3, 4], []]
    rows = [instance(d, feature_0=bags0[i], feature_1=[7 - i], feature_2=[i % 2]) for i, d in enumerate(dense)]
    cols = {
        "dense": dense,
        "sparse": {
            "feature_1": {"values": [7, 6, 5, 4]},
            "feature_2": {"values": [0, 1, 0, 1], "lengths": [1, 1, 1, 1]},
            "feature_0": {"values": [1, 2, 3, 4], "lengths": [0, 2, 2, 0]},
        },
    }
    want = run(parser, model, config, [body({"instances": rows})])[0]
    assert len(set(want)) == 4
    assert run(parser, model, config, [body({"columns": cols})])[0] == want
    # the same rows as a context (dense, feature_1 shared) plus columns
    shared = [instance(DENSE, feature_0=[i], feature_1=[9], feature_2=[3 - i]) for i in range(4)]
    ctx = {"dense": DENSE, "sparse": {"keys": ["feature_1"], "values": [9], "lengths": [1]}}
    cols = {"sparse": {"feature_2": {"values": [3, 2, 1, 0]}, "feature_0": {"values": [0, 1, 2, 3]}}}
    got = run(parser, model, config, [body({"context": ctx, "columns": cols})])[0]
    assert got == run(parser, model, config, [body({"instances": shared})])[0] and len(set(got)) == 4


def test_columns_form_in_a_mixed_batch_and_on_the_fast_decoder(parser, model, config):
    """A columns request shares a batch with row-form requests; a body past the fast decoder's
    threshold parses to the same arrays."""
    cols = {"columns": {"dense": [DENSE] * 3, "sparse": {"feature_2": {"values": [1, 2, 3]}}}}
    single = body(instance(DENSE, feature_0=[1]))
    rows = [instance(DENSE, feature_2=[i]) for i in (1, 2, 3)]
    got = run(parser, model, config, [single, body(cols), single])
    assert got == run(parser, model, config, [single, body({"instances": rows}), single])
    small, large = parser.parse(body(cols)).segments(), parser.parse(body(cols) + b" " * 5000).segments()
    for field in ("dense", "values", "seg_feature", "seg_length", "seg_row"):
        assert np.array_equal(getattr(small, field), getattr(large, field)), field


def test_single_hot_shortcut_builds_the_same_kjt_as_the_general_path(parser, config):
    """Requests whose every feature has one id per row carry ParsedRequest.onehot; collate's
    shortcut for them gives the KJT of the general scatter, alone and in batches."""
    import dataclasses

    ctx = {"dense": DENSE, "sparse": {"keys": ["feature_2"], "values": [7], "lengths": [1]}}
    hot = [
        body({"instances": [instance([i] * 5, feature_2=[i], feature_0=[i + 1]) for i in range(3)]}),
        body(
            {
                "context": ctx,
                "candidates": [{"sparse": {"keys": ["feature_0"], "values": [i], "lengths": [1]}} for i in range(4)],
            }
        ),
        body({"context": ctx, "columns": {"sparse": {"feature_0": {"values": [5, 6]}}}}),
        body(
            {
                "columns": {
                    "dense": [DENSE] * 2,
                    "sparse": {"feature_2": {"values": [1, 2], "lengths": [1, 1]}, "feature_0": {"values": [3, 4]}},
                }
            }
        ),
    ]
    parsed = [parser.parse(b) for b in hot]
    assert all(p.onehot is not None and p.onehot[0] == (0, 2) for p in parsed)
    multi = parser.parse(body({"instances": [instance(DENSE, feature_0=[1, 2]), instance(DENSE, feature_0=[3, 4])]}))
    assert multi.onehot is None
    for batch_of in (parsed[:1], parsed[1:3], parsed, parsed + [multi]):
        fast, _ = collate(batch_of, config)
        slow, _ = collate([dataclasses.replace(p.segments(), onehot=None) for p in batch_of], config)
        assert torch.equal(fast.dense, slow.dense) and fast.rows == slow.rows
        for part in ("values", "lengths"):
            assert torch.equal(getattr(fast.sparse, part)(), getattr(slow.sparse, part)()), part


def test_layout_of_the_json_text_does_not_change_the_rows(parser, config):
    """The fast decoder compares key and lengths lists as raw JSON text: rows whose lists differ
    only in spacing parse to the batch of the compact JSON (single-hot or not)."""
    pad = b" " * 4096  # past the fast decoder's threshold

    def kjt_of(raw):
        batch, errors = collate([parser.parse(raw + pad)], config)
        assert errors == {}
        return batch.dense.tolist(), batch.sparse.lengths().tolist(), batch.sparse.values().tolist()

    multi = [instance([i / 5] * 5, feature_0=[i], feature_2=[i + 1, 2] if i % 3 == 0 else [i]) for i in range(8)]
    single = [instance([i / 5] * 5, feature_0=[i], feature_2=[i]) for i in range(8)]
    for rows in (multi, single):
        compact = json.dumps({"instances": rows}, separators=(",", ":")).encode()
        variants = [
            json.dumps({"instances": rows}, indent=1).encode(),
            compact.replace(b'"lengths":[1,1]', b'"lengths": [1, 1]', 3),
        ]
        assert variants[1] != compact
        assert all(kjt_of(raw) == kjt_of(compact) for raw in variants)
    assert parser.parse(json.dumps({"instances": single}).encode() + pad).onehot is not None


def test_many_instances_with_one_key_list_parse_as_row_by_row(parser, model, config):
    """The vectorised path (one key list) and the row-by-row path (key orders differ) agree."""
    same = [instance([i / 7] * 5, feature_0=[i % 20], feature_1=[i % 30, 1], feature_2=[]) for i in range(8)]
    reordered = [
        instance(r["dense"], feature_2=[], feature_1=[i % 30, 1], feature_0=[i % 20]) if i % 2 else r
        for i, r in enumerate(same)
    ]
    a, b = (parser.parse(body({"instances": x})) for x in (same, reordered))
    assert isinstance(a.values, np.ndarray) and isinstance(b.values, list)
    assert run(parser, model, config, [body({"instances": same})]) == run(
        parser, model, config, [body({"instances": reordered})]
    )


def test_rows_of_a_key_major_kjt():
    """F=2, B=3, lengths [1, 2, 0 | 0, 1, 1]: rows [1, 3) are lengths [2, 0 | 1, 1], their values
    and weights in the same order."""
    from dlrmkit.batch import rows_of

    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([10, 11, 12, 20, 21]),
        lengths=torch.tensor([1, 2, 0, 0, 1, 1]),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
    )
    part = rows_of(kjt, 1, 3)
    assert part.keys() == ["a", "b"] and part.stride() == 2
    assert part.lengths().tolist() == [2, 0, 1, 1]
    assert part.values().tolist() == [11, 12, 20, 21]
    assert part.weights().tolist() == pytest.approx([0.2, 0.3, 0.4, 0.5])
    assert rows_of(kjt, 0, 1).values().tolist() == [10] and rows_of(kjt, 0, 1).lengths().tolist() == [1, 0]


def test_row_spans_split_a_forward_into_nearly_equal_parts_at_most_as_many_as_allowed():
    from dlrmkit.batch import row_spans

    assert row_spans(671, 350, 2) == [(0, 335), (335, 671)]
    assert row_spans(350, 350, 2) == [(0, 350)]  # not more than split_rows: whole
    assert row_spans(1400, 350, 2) == [(0, 700), (700, 1400)]  # the cap: parts grow past split_rows
    assert row_spans(10, 3, 8) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert row_spans(10, 0, 8) == [(0, 10)]  # 0: never
    assert row_spans(10, 3, 1) == [(0, 10)]


class RecordingPool:
    """A real thread pool that records what it is given: which parts ran off the caller's thread."""

    def __init__(self, fail_on_rows: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.rows, self.fail_on_rows = ThreadPoolExecutor(4), [], fail_on_rows

    def submit(self, fn, model, dense, sparse, config):
        self.rows.append(dense.shape[0])
        if dense.shape[0] == self.fail_on_rows:

            def broken(*_):
                raise RuntimeError("a part failed")

            return self.pool.submit(broken)
        return self.pool.submit(fn, model, dense, sparse, config)


def test_a_forward_split_into_parts_on_threads_scores_as_the_whole_batch(parser, model, config):
    """handler.split_rows: a batch of more rows runs as parts at once (the first on the caller's
    thread), multi-hot bags, omitted keys and requests cut across parts; the scores, per request
    and in order, are the whole forward's."""

    rng = np.random.default_rng(5)
    reqs = [
        body(
            {
                "instances": [
                    instance(
                        rng.normal(size=5).round(3).tolist(),
                        **{
                            f"feature_{k}": rng.integers(0, 20, rng.integers(0, 4)).tolist()
                            for k in range(3)
                            if rng.random() < 0.8
                        },
                    )
                    for _ in range(n)
                ]
            }
        )
        for n in (3, 1, 4, 2)
    ]
    batch, errors = collate([parser.parse(r) for r in reqs], config)
    assert errors == {} and batch.dense.shape[0] == 10
    whole = scores(model, batch, config)
    split = config.with_changes(split_rows=3)
    pool = RecordingPool()
    parts = scores(model, batch, split, pool, parts=4)  # type: ignore[arg-type]
    assert pool.rows == [3, 2, 3]  # 4 parts of 2-3 rows: the first ran here
    assert [len(p) for p in parts] == [3, 1, 4, 2]
    for w, p in zip(whole, parts):
        assert p == pytest.approx(w, abs=1e-6)
    assert len({round(s, 4) for p in parts for s in p}) == 10  # every row scored on its own inputs
    assert scores(model, batch, split, None, parts=4) == whole  # no pool: whole
    with pytest.raises(RuntimeError, match="a part failed"):
        scores(model, batch, split, RecordingPool(fail_on_rows=3), parts=4)  # type: ignore[arg-type]
