"""The release matrix's split and its one-commit bookkeeping (compat/matrix.py, compat/matrix_plugin.py,
compat/evidence.py, compat/report.py): every test file runs somewhere, once named; a release's evidence
rebuilt by a one-commit run names that commit alone; the report says loudly when releases differ."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat"
sys.path.insert(0, str(COMPAT))

import evidence  # noqa: E402
import report  # noqa: E402

from compat import matrix_plugin  # noqa: E402

import matrix  # noqa: E402

TEST_FILES = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py"))


def _places(path: str) -> list[str]:
    """Where the split puts the test file ``path``: every list that names it (or a folder above it)."""
    lists = (("PER_RELEASE", matrix.PER_RELEASE), ("NOT_IN_MATRIX", matrix.NOT_IN_MATRIX))
    places = [name for name, files in lists if path in files]
    places += [
        "ONCE" for once in matrix.ONCE_FILES if path == once or path.startswith(once.rstrip("/") + "/")
    ]
    return places


@pytest.mark.parametrize("path", TEST_FILES)
def test_every_test_file_is_in_the_split_exactly_once(path):
    """A new test file must be put in PER_RELEASE, ONCE or NOT_IN_MATRIX (compat/matrix.py): the matrix
    runs the files named there, so one named nowhere would be dropped without a word."""
    assert len(_places(path)) == 1, f"{path}: in {_places(path) or 'none'} of compat/matrix.py's lists"


def test_the_split_names_only_files_that_exist():
    named = [
        *matrix.PER_RELEASE,
        *matrix.ONCE,
        *matrix.NOT_IN_MATRIX,
        *matrix.COMPILE_SMOKE,
        *matrix.PROBE_ONCE,
    ]
    for node in named:
        path, _, function = node.partition("[")[0].partition("::")
        assert (ROOT / path).exists(), node
        if function:
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), node
            assert path in matrix.PER_RELEASE, f"{node}: a test of a file the releases run"
    assert len(set(matrix.PER_RELEASE)) == len(matrix.PER_RELEASE)
    assert set(matrix.PROBE_FILES) <= set(matrix.PER_RELEASE)


def test_probe_tests_live_in_the_probe_files():
    """The probe part runs PROBE_FILES only and the suite part leaves out every test that takes the
    ``probe`` fixture: a probe test anywhere else would run in neither."""
    for path in TEST_FILES:
        takes_probe = re.search(r"^def test_\w+\([^)]*\bprobe\b", (ROOT / path).read_text(), re.M)
        assert not takes_probe or path in matrix.PROBE_FILES, path


def test_the_sample_spans_the_releases():
    assert set(matrix.CI_RELEASES) <= set(matrix.SAMPLE) <= set(matrix.RELEASES)
    assert matrix.RELEASES[0] in matrix.SAMPLE and matrix.RELEASES[-1] in matrix.SAMPLE


@pytest.mark.parametrize(
    ("nodeid", "markers", "once"),
    [
        ("tests/test_cli.py::test_version[x]", set(), True),
        ("tests/integrations/test_ray.py::test_workers", set(), True),
        ("tests/test_decoders.py::test_compiled_decoder_matches_eager[bart]", set(), True),
        ("tests/test_decoders.py::test_compiled_decoder_matches_eager_too", set(), False),
        ("tests/test_packed.py::test_compiled_rows", {"compile"}, True),
        ("tests/test_compile.py::test_no_graph_break_of_its_own[llama]", {"compile"}, False),
        ("tests/test_invariant.py::test_any_padding", {"invariant"}, False),
        ("tests/test_unpad.py::test_rows[gpt2-flex_attention-right]", set(), True),
        ("tests/test_unpad.py::test_rows[gpt2-sdpa-right]", set(), False),
    ],
)
def test_what_runs_once(nodeid, markers, once):
    assert matrix.runs_once(nodeid, markers) is once


def test_a_name_with_a_word_names_those_parameters_only():
    names = ["tests/test_architectures.py::test_verify_covered_architecture[eager]"]
    assert matrix.named("tests/test_architectures.py::test_verify_covered_architecture[gpt2-eager]", names)
    assert not matrix.named("tests/test_architectures.py::test_verify_covered_architecture[gpt2-sdpa]", names)
    assert not matrix.named(
        "tests/test_architectures.py::test_packed_rows_covered_architecture[gpt2-eager]", names
    )


def _item(nodeid: str, fixtures=(), markers=()):
    return SimpleNamespace(
        nodeid=nodeid.removeprefix("tests/"),
        path=ROOT / nodeid.partition("::")[0],
        fixturenames=list(fixtures),
        iter_markers=lambda: [SimpleNamespace(name=name) for name in markers],
    )


def test_each_part_selects_its_tests():
    probe = _item("tests/test_architectures.py::test_verify_covered_architecture[gpt2]", ["probe"])
    cli = _item("tests/test_cli.py::test_help")
    smoke = _item("tests/test_compile.py::test_no_graph_break_of_its_own[gpt2]", markers=["compile"])
    heavy = _item(
        "tests/test_compile.py::test_decode_loop_compiles_no_more_graphs_than_stock", markers=["compile"]
    )
    items = (probe, cli, smoke, heavy)
    chosen = {
        part: [item for item in items if matrix_plugin.selected(item, part)] for part in matrix_plugin.PARTS
    }
    assert chosen == {"probe": [probe], "suite": [smoke], "once": [cli, heavy]}
    assert [item for item in items if matrix_plugin.selected(item, "suite", sample=True)] == [
        cli,
        smoke,
        heavy,
    ]


def test_the_two_parts_of_a_release_are_its_pytest_runs():
    probe = matrix.pytest_args(matrix.NEWEST, "probe", Path("p.xml"))
    assert "--outside-ranges" in probe and set(matrix.PROBE_FILES) <= set(probe)
    sample = matrix.pytest_args(matrix.NEWEST, "suite", Path("s.xml"))
    assert "--matrix-sample" in sample and set(matrix.ONCE_FILES) <= set(sample)
    other = next(release for release in matrix.RELEASES if release not in matrix.SAMPLE)
    per_release = matrix.pytest_args(other, "suite", Path("s.xml"))
    assert "--matrix-sample" not in per_release and not set(matrix.ONCE_FILES) & set(per_release)
    assert "--outside-ranges" not in per_release and set(matrix.PER_RELEASE) <= set(per_release)


def test_a_one_commit_run_rebuilds_the_release_at_its_commit(tmp_path, monkeypatch):
    """A release's file after a one-commit run holds that run alone: its commit is the only one named,
    so earlier runs' results (and their commits) cannot stand beside it; --resume reads it back."""
    monkeypatch.setattr(evidence, "FOLDER", tmp_path)
    old = evidence.load("4.40.2")
    old["code"] = {"probe": ["aaaaaaa", "bbbbbbb"], "suite": ["aaaaaaa"]}
    old["suite"] = {"test_cli::test_help": {"-": ["pass", "", ""]}}
    evidence.save(old)
    assert evidence.at_commit("4.40.2") is None
    fresh = evidence.restart("4.40.2", "ccccccc", sample=False)
    suite = [{"test": "test_invariant::test_x", "outcome": "pass", "message": "", "properties": {}}]
    probe = [{"test": "test_architectures::test_y[gpt2]", "outcome": "pass", "message": "",
              "properties": {"probe_type": "gpt2", "kind": "exact"}}]  # fmt: skip
    evidence.merge(fresh, probe, "ccccccc", probe_only=True)
    evidence.merge(fresh, suite, "ccccccc")
    fresh["cases"] = {"gpt2": {"cases": 40}}
    evidence.save(fresh)
    saved = evidence.load("4.40.2")
    assert saved["code"] == {"probe": ["ccccccc"], "suite": ["ccccccc"]}
    assert saved["run"] == {"commit": "ccccccc", "ran": "per release"}
    assert "test_cli::test_help" not in saved["suite"]
    assert evidence.at_commit("4.40.2") == "ccccccc"
    assert evidence.dumps(saved) == (tmp_path / "4.40.2.json").read_text()


def _entry(commits: list[str], tests: str = "") -> dict:
    return {"code": {"suite": commits[:1], "probe": commits}, "run": {"ran": tests} if tests else {}}


def test_the_report_says_when_releases_are_not_at_one_commit():
    mixed = {
        "4.20.1": _entry(["aaaaaaa"], "whole suite"),
        "4.21.3": _entry(["aaaaaaa"], "per release"),
        "4.22.2": _entry(["bbbbbbb"], "per release"),
        "4.23.1": _entry(["aaaaaaa", "ccccccc"]),
    }
    assert report.one_commit(mixed) == (
        "aaaaaaa",
        {("bbbbbbb",): ["4.22.2"], ("aaaaaaa", "ccccccc"): ["4.23.1"]},
    )
    text = "\n".join(report._one_commit(mixed))
    assert "NOT AT ONE COMMIT: 2 of 4 releases" in text and "4.22.2 at `bbbbbbb`" in text
    assert "4.23.1 at 2 commits" in text and "SAMPLE only" in text
    same = {release: _entry(["aaaaaaa"], "per release") for release in mixed}
    text = "\n".join(report._one_commit(same))
    assert "NOT AT ONE COMMIT" not in text and "At one commit: `aaaaaaa`" in text


def test_the_committed_report_says_whether_it_is_at_one_commit():
    text = (COMPAT / "REPORT.md").read_text()
    assert ("**NOT AT ONE COMMIT" in text) != ("**At one commit:" in text)
    assert "Mechanics run on SAMPLE only" in text


@pytest.mark.parametrize("script", ["one_commit.sh", "run_matrix.sh", "probe_matrix.sh"])
def test_the_matrix_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(COMPAT / script)]).returncode == 0


def test_one_commit_refuses_a_dirty_tree(tmp_path):
    """The matrix measures a commit: with uncommitted changes to the code it stops before installing
    anything (a copy of compat/ in a fresh repository, one commit, then a change)."""
    repo = tmp_path / "repo"
    (repo / "compat").mkdir(parents=True)
    (repo / "hfpatch").mkdir()
    for name in ("one_commit.sh", "matrix.py", "releases.txt"):
        (repo / "compat" / name).write_text((COMPAT / name).read_text())
    (repo / "hfpatch" / "x.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (repo / "hfpatch" / "x.py").write_text("x = 2\n")
    done = subprocess.run(["bash", str(repo / "compat" / "one_commit.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "MATRIX_WORK": str(tmp_path / "work")})  # fmt: skip
    assert done.returncode == 1 and "uncommitted changes" in done.stderr
    assert not (tmp_path / "work").exists()


def test_one_commit_measures_an_earlier_commit_only_with_heads_runtime(tmp_path):
    """``--at COMMIT`` (a run resumed after commits to tests or documents) refuses a commit whose hfpatch/
    is not HEAD's, before installing anything."""
    repo = tmp_path / "repo"
    (repo / "compat").mkdir(parents=True)
    (repo / "hfpatch").mkdir()
    for name in ("one_commit.sh", "matrix.py", "releases.txt"):
        (repo / "compat" / name).write_text((COMPAT / name).read_text())
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for value in (1, 2):
        (repo / "hfpatch" / "x.py").write_text(f"x = {value}\n")
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", str(value)], check=True)
    done = subprocess.run(["bash", str(repo / "compat" / "one_commit.sh"), "--at", "HEAD~1"],
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "MATRIX_WORK": str(tmp_path / "work")})  # fmt: skip
    assert done.returncode == 1 and "is not HEAD's" in done.stderr
    assert not (tmp_path / "work").exists()


def test_the_collapsed_suite_gives_the_same_cells():
    """A one-commit file keeps one entry per distinct result of a test function (compat/evidence.py's
    collapse_suite), and a column's skips only where nothing in it ran: the report's cells are the same."""
    found = evidence.load("")
    found["reasons"] = ["no gemma here", "no cache", "unused"]
    found["suite"] = {
        "test_invariant::test_a": {"gpt2-1": ["pass", "gpt2", "I1"], "gpt2-2": ["pass", "gpt2", "I1"],
                                   "gpt2-3": [1, "gpt2", "I1"], "gemma-1": [0, "gemma", "I1"]},
        "test_invariant::test_b": {"gpt2-1": ["fail", "gpt2", "I2"], "gemma-1": [0, "gemma", "I1"]},
    }  # fmt: skip
    cells = report.suite_cells(found)
    collapsed = evidence.collapse_suite(found)
    assert report.suite_cells(collapsed) == cells
    assert collapsed["reasons"] == ["no gemma here"]
    assert collapsed["suite"]["test_invariant::test_a"] == {
        "gpt2 I1 pass x2": ["pass", "gpt2", "I1"],
        "gemma I1 skip0 x1": [0, "gemma", "I1"],
    }


def test_the_probe_leaves_out_only_the_sdpa_twins_before_4_36():
    """Before 4.36 no release reads the attention a config asks for: the SDPA probe tests there run the
    eager code again; they run on SAMPLE releases only (compat/matrix.py's PROBE_ONCE), nothing else."""
    sdpa = _item("tests/test_architectures.py::test_verify_covered_architecture[gpt2-sdpa]", ["probe"])
    eager = _item("tests/test_architectures.py::test_verify_covered_architecture[gpt2-eager]", ["probe"])
    assert not matrix_plugin.selected(sdpa, "probe", release="4.35.2")
    assert matrix_plugin.selected(sdpa, "probe", sample=True, release="4.20.1")
    assert matrix_plugin.selected(sdpa, "probe", release="4.36.2")
    assert matrix_plugin.selected(eager, "probe", release="4.20.1")
    assert all(before == "4.36" for before, _ in matrix.PROBE_ONCE.values())
