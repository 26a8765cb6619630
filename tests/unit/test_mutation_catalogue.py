"""The mutation catalogue stays applicable: every snippet still occurs once, every named test exists.

``scripts/mutation_check.py --check-snippets`` in the fast suite, so a refactor that moves a snippet or
renames a test fails here instead of leaving an entry that the (hour-long) mutation run can only call
``not-applied`` (docs/testing.md, "The mutation check").
"""

from __future__ import annotations

import pytest
from project_scripts import load_script


@pytest.fixture(scope="module")
def mutation_check():
    return load_script("mutation_check")


def test_every_catalogue_snippet_occurs_once_and_every_named_test_exists(mutation_check, capsys):
    status = mutation_check.main(["--check-snippets"])
    report = capsys.readouterr().out
    stale = [line for line in report.splitlines() if line.startswith("not-applied")]
    assert status == 0 and not stale, (
        "scripts/mutations.toml has entries the code or the tests moved away from; update their old/new "
        "snippets or test ids:\n" + "\n".join(stale))


def test_a_moved_snippet_or_a_renamed_test_is_reported(mutation_check, tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("x = 1\nx = 1\ny = 2\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("def test_y():\n    pass\n\n\nclass TestX:\n    pass\n")
    Mutation = mutation_check.Mutation

    def reasons(old, tests, file="pkg/mod.py"):
        return mutation_check.stale_reasons(Mutation("m", file, old, "", tests, "", ""), tmp_path)

    assert reasons("y = 2", ("tests/test_mod.py::test_y[1]", "tests/test_mod.py::TestX::test_a")) == []
    assert reasons(("y = 2", "x = 1"), ("tests/test_mod.py",)) == [
        "snippet 2 occurs 2 times in pkg/mod.py (must be exactly once)"]
    assert reasons("z = 3", ("tests/test_mod.py::test_z", "tests/test_gone.py")) == [
        "the snippet occurs 0 times in pkg/mod.py (must be exactly once)",
        "test_z not found in tests/test_mod.py", "test file tests/test_gone.py not found"]
    assert reasons("y = 2", (), file="pkg/moved.py") == [
        "the snippet occurs 0 times in pkg/moved.py (must be exactly once)"]
