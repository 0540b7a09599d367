"""results/ and its index (scripts/results_index.py): the committed index is current, every file
lies in a run folder with a run.json, and the check fails on each way results/ goes out of shape."""

import json
from pathlib import Path

import pytest

from scripts import results_index

RUN = {
    "title": "t",
    "date": "2026-01-02",
    "commit": "abc1234",
    "cpu": "AMD EPYC",
    "isa": "AVX2",
    "command": "make bench",
}


def test_the_committed_index_is_current_and_every_result_is_in_a_run_folder(capsys):
    assert results_index.main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A results/ with one run (two files) and its index, as the script writes it."""
    run = tmp_path / "2026-01-02-bench"
    (run / "loadgen").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(RUN))
    (run / "bench.md").write_text("# figures\n")
    (run / "loadgen" / "summary.txt").write_text("VALID\n")
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "scratch.json").write_text("{}")  # gitignored scratch: never a problem
    assert results_index.main([], results=tmp_path) == 0
    return tmp_path


def test_the_index_links_every_file_of_a_run_newest_first(results: Path):
    later = results / "2026-02-03-later"
    later.mkdir()
    (later / "run.json").write_text(json.dumps({**RUN, "date": "2026-02-03", "title": "later run"}))
    text = results_index.render(results)
    for link in (
        "(2026-01-02-bench/run.json)",
        "(2026-01-02-bench/bench.md)",
        "(2026-01-02-bench/loadgen/summary.txt)",
    ):
        assert link in text
    assert "- CPU: AMD EPYC; ISA: AVX2" in text and "`make bench`" in text
    assert text.index("## 2026-02-03: later run") < text.index("## 2026-01-02: t")
    assert "tmp/" not in text


def test_the_check_passes_on_a_fresh_index(results: Path):
    assert results_index.check(results) == []


def test_the_check_fails_on_a_stray_file(results: Path, capsys):
    (results / "benchmark.json").write_text("{}")
    assert results_index.main(["--check"], results=results) == 1
    assert "benchmark.json is not inside a run folder" in capsys.readouterr().err


def test_the_check_fails_on_a_run_folder_without_run_json(results: Path, capsys):
    (results / "2026-01-02-bench" / "run.json").unlink()
    assert results_index.main(["--check"], results=results) == 1
    assert "2026-01-02-bench/ has no run.json" in capsys.readouterr().err


def test_the_check_fails_on_a_stale_index(results: Path, capsys):
    (results / "2026-01-02-bench" / "more.md").write_text("# more\n")  # a file the index does not link
    assert results_index.main(["--check"], results=results) == 1
    assert "README.md is stale" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad, says",
    [
        ({**RUN, "cpu": ""}, "lacks cpu"),
        ({k: v for k, v in RUN.items() if k != "command"}, "lacks command"),
        ({**RUN, "date": "2026-01-03"}, "is not the folder's"),
    ],
)
def test_the_check_fails_on_an_incomplete_run_json(results: Path, bad: dict, says: str):
    (results / "2026-01-02-bench" / "run.json").write_text(json.dumps(bad))
    assert any(says in p for p in results_index.check(results))


def test_a_folder_not_named_by_date_is_refused(results: Path):
    (results / "loadgen").mkdir()
    assert results_index.check(results) == ["loadgen/ is not named <YYYY-MM-DD>-<slug>"]
