"""The docs (README.md, docs/*.md) against the tree: every repository path they mention exists,
every relative link resolves, every `make X` is a target, `make help` lists every target, and the
shell blocks marked `<!-- runnable -->` run and print what the docs show (unit, a few seconds)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
PATH_ENDINGS = (".py", ".yaml", ".yml", ".json", ".md", ".properties", ".sh", ".txt", ".png")
# Created at run time (make serve, train.py, the docs' own examples), or not paths of this repo.
NOT_REPO_PATHS = (
    ".venv/",
    "model_store/",
    "logs/",
    ".serve/",
    "trained/",
    "checkpoint/",
    "my-model.yaml",
    "my-criteo.yaml",
    "heldout.json",
    "verify.jsonl",
    "dense-plan.json",  # a file in an archive (dlrmkit.dense.PLAN_FILE)
    "build/docker/",
    "key_file.json",
    "OUT.yaml",
    "application/",
    "text/",
    "nvidia.com/",
    "examples/",
)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
RUNNABLE = re.compile(r"^<!-- runnable -->\n```(?:sh|bash|console)?\n(.*?)^```", re.S | re.M)


def repo_paths() -> set[str]:
    """Every file and folder of the tree (relative, folders also with a trailing /), without
    the virtual environment, git's data and what a run leaves behind."""
    skip = {".venv", ".git", "__pycache__", ".pytest_cache", "model_store", "logs", ".serve"}
    out = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(top).relative_to(ROOT)
        for name in dirs:
            out |= {(rel / name).as_posix(), (rel / name).as_posix() + "/"}
        out |= {(rel / name).as_posix() for name in files}
    return out


def code_text(text: str) -> str:
    """The fenced blocks and backtick spans of a markdown text: where commands are shown."""
    return "\n".join(FENCE.findall(text) + re.findall(r"`([^`\n]+)`", FENCE.sub("", text)))


def mentioned_paths(text: str) -> list[str]:
    """Backticked words and link targets (outside fenced blocks) that look like repo paths."""
    prose = FENCE.sub("", text)
    words = [w for span in re.findall(r"`([^`\n]+)`", prose) for w in span.split()]
    words += [t for t in re.findall(r"\]\(([^)\s]+)\)", prose)]
    out = []
    for w in words:
        w = w.split("#")[0].lstrip("(\"'").rstrip(".,:;)\"'")
        if (
            not w
            or "://" in w
            or w.startswith(("/", "-"))
            or not re.fullmatch(r"[\w.\-/]+", w)
            or not ("/" in w or w.endswith(PATH_ENDINGS))
            or w.startswith(NOT_REPO_PATHS)
        ):
            continue
        out.append(w)
    return out


def makefile_targets() -> set[str]:
    rules = re.findall(r"^([a-z][a-z-]*):(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return set(rules)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_mentioned_path_exists(doc):
    paths = repo_paths()
    here = doc.parent.relative_to(ROOT).as_posix()
    missing = []
    for w in mentioned_paths(doc.read_text()):
        near = os.path.normpath(f"{here}/{w}") if here != "." else w
        # a bare name or a tail (`seed_single.json`, `base/sizing.yaml`) names a file in context
        if not ({w, w.rstrip("/"), near, near.rstrip("/")} & paths or any(p.endswith("/" + w) for p in paths)):
            missing.append(w)
    assert not missing, f"{doc.name} mentions paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    links = re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text()))
    broken = [
        t
        for t in links
        if "://" not in t and not t.startswith(("#", "mailto:")) and not (doc.parent / t.split("#")[0]).exists()
    ]
    assert not broken, f"{doc.name}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_mentioned_exists(doc):
    mentioned = set(re.findall(r"(?<![\w-])make ([a-z][a-z-]*)", code_text(doc.read_text())))
    assert mentioned <= makefile_targets(), f"{doc.name}: not Makefile targets: {mentioned - makefile_targets()}"


def test_make_help_lists_every_target():
    out = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    targets = makefile_targets() - {"FORCE"}
    assert targets, "no targets parsed from the Makefile"
    assert listed == targets, f"make help lists {sorted(listed)}, the Makefile has {sorted(targets)}"
    assert all(len(line.split(None, 1)) == 2 for line in out.splitlines() if line.strip())


def runnable_blocks():
    return [
        pytest.param(block, id=f"{doc.name}:{i}")
        for doc in DOCS
        for i, block in enumerate(RUNNABLE.findall(doc.read_text()))
    ]


@pytest.mark.parametrize("block", runnable_blocks())
def test_runnable_block(block):
    """`$ cmd` lines are run and every other shown line (but `...`) must be in their output;
    a block without `$ ` runs every line that is not a comment."""
    lines = block.splitlines()
    commands = [ln[2:] for ln in lines if ln.startswith("$ ")]
    shown = [ln for ln in lines if not ln.startswith("$ ") and ln.strip() not in ("", "...")] if commands else []
    commands = commands or [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    out = ""
    for cmd in commands:
        done = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{cmd!r} exited {done.returncode}: {done.stderr[-2000:]}"
        out += done.stdout
    got = {" ".join(ln.split()) for ln in out.splitlines()}
    missing = [ln for ln in shown if " ".join(ln.split()) not in got]
    assert not missing, f"the docs show lines the commands did not print: {missing}"


def test_there_are_runnable_blocks():
    assert len(runnable_blocks()) >= 2
