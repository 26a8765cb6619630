"""``make mutation``'s choices, without running mutmut (docs/testing.md, "Generated mutants"): which files a
change or ``PATHS`` names, which tests run, and which survivors docs/testing.md justifies."""

from __future__ import annotations

import pytest
from project_scripts import load_script


@pytest.fixture(scope="module")
def generated():
    return load_script("mutation_generated")


def test_paths_are_the_python_files_under_src_they_name(generated) -> None:
    files = generated.expand(["src/oea/bench/serve", "src/oea/soak/checks.py"])
    assert "src/oea/bench/serve/engines.py" in files and "src/oea/soak/checks.py" in files
    assert all(f.startswith("src/") and f.endswith(".py") for f in files)
    assert "src/oea/soak/mix.py" not in files
    with pytest.raises(SystemExit, match="not under src/"):
        generated.expand(["tests/unit"])


def test_the_tests_are_those_naming_the_package_without_the_source_text_tests(generated) -> None:
    tests = generated.test_files(["src/oea/bench/serve/engines.py"])
    assert "tests/unit/test_bench_serve_engines.py" in tests
    assert "tests/unit/test_mutation_survivors_bench_serve.py" in tests
    assert not any(t.endswith(generated.SOURCE_TEXT_TESTS) or "/engines/" in t for t in tests)
    assert generated.package_of("src/oea/integrations/sglang/routing.py") == "oea.integrations.sglang"


def test_every_survivor_named_equivalent_is_read_from_the_docs(generated) -> None:
    names = generated.equivalent_mutants()
    assert "oea.bench.serve.engines.x_detect_engine__mutmut_4" in names
    assert all(n.startswith("oea.") and "__mutmut_" in n for n in names)


def test_mutation_work_chooses_the_scratch_folder_so_two_runs_never_share_one(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MUTATION_WORK", raising=False)
    default = load_script("mutation_generated")
    assert default.WORK == default.ROOT / ".cache" / "mutation-generated"
    monkeypatch.setenv("MUTATION_WORK", str(tmp_path / "b"))
    other = load_script("mutation_generated")
    work = tmp_path / "b"
    assert (work, work / "tree") == (other.WORK, other.TREE)
