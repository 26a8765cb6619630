"""Output paths are checked before a command computes anything: a place it cannot write is one stderr line
naming the flag, exit 2, nothing written, and the computation never starts."""

from __future__ import annotations

import pathlib

import pytest

from oea.cli import main
from oea.console import check_output_file, check_output_folder

# /proc accepts no new files, whoever runs the tests (root included): the probe must say so, naming the flag.
UNWRITABLE = pathlib.Path("/proc")


def _computations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every computation these commands start fails the test if it runs."""

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the computation ran before the output path was checked")

    import oea.models.inflate
    import oea.report.build
    import oea.traces.capture
    import oea.tuning.compare
    import oea.tuning.recommend

    monkeypatch.setattr(oea.tuning.compare, "compare_policies", never)
    monkeypatch.setattr(oea.report.build, "build_report", never)
    monkeypatch.setattr(oea.models.inflate, "check_disk", never)
    monkeypatch.setattr(oea.tuning.recommend, "measure_samples", never)
    monkeypatch.setattr(oea.traces.capture, "capture_embedded", never)


CASES: list[tuple[list[str], str]] = [
    (["compare", "--layers", "0", "--num-batches", "2", "--plot", "no/such/dir/p.png"],
     "--plot no/such/dir/p.png: folder no/such/dir does not exist"),
    (["compare", "--layers", "0", "--num-batches", "2", "--plot", str(UNWRITABLE / "p.png")],
     f"--plot {UNWRITABLE}/p.png: cannot write in {UNWRITABLE}"),
    (["report", "--quick", "--out", str(UNWRITABLE / "oea-report")],
     f"--out {UNWRITABLE}/oea-report: cannot write in {UNWRITABLE}"),
    (["inflate", "--like", "qwen3-30b-a3b", "--out", str(UNWRITABLE / "inflated")],
     f"--out {UNWRITABLE}/inflated: cannot write in {UNWRITABLE}"),
    (["calibrate", "layers", "--out", str(UNWRITABLE / "k0.json")], f"--out {UNWRITABLE}/k0.json: cannot write in"),
    (["capture", "--out", str(UNWRITABLE / "t.safetensors")], f"--out {UNWRITABLE}/t.safetensors: cannot write in"),
    (["capture", "--out", str(UNWRITABLE / "new") + "/"], f"--out {UNWRITABLE}/new/embedded-trace.safetensors: "
                                                           f"cannot write in {UNWRITABLE}"),
    (["traces", "import", "in.npz", "--out", str(UNWRITABLE / "t.safetensors"), "--num-experts", "8", "--top-k",
      "2"], f"--out {UNWRITABLE}/t.safetensors: cannot write in {UNWRITABLE}"),
    (["report", "--quick", "--out", "a-file/inside"], "a-file is a file, not a folder"),
]


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[f"{argv[0]} {text.split(': ')[0]}" for argv, text in CASES])
def test_an_unwritable_output_is_named_before_any_work(
    argv: list[str], fragment: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("keep")
    _computations(monkeypatch)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and out == "", err
    assert fragment in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "nothing may be written"


def test_the_checks_create_nothing_and_accept_what_can_be_written(tmp_path: pathlib.Path) -> None:
    assert check_output_file(tmp_path / "p.png", "--plot") == tmp_path / "p.png"
    assert check_output_folder(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert check_output_file(tmp_path / "new" / "t.safetensors", "--out", create_folders=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"--out .*: is a folder; give a file name"):
        check_output_file(tmp_path, "--out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        check_output_folder(tmp_path / "full", "--out", empty=True)


def test_capture_into_a_new_folder_ending_in_a_slash_creates_it(tmp_path: pathlib.Path) -> None:
    from oea.traces.capture import DEFAULT_FILE, output_path

    path = output_path(str(tmp_path / "runs" / "today") + "/")
    assert path == tmp_path / "runs" / "today" / DEFAULT_FILE
    assert not (tmp_path / "runs").exists()  # created only when the trace is written
    with pytest.raises(ValueError, match=r"--out .*/runs/x\.safetensors: folder .*/runs does not exist"):
        output_path(str(tmp_path / "runs" / "x.safetensors"))
