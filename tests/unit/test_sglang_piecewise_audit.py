"""``scripts/sglang_piecewise_audit.py`` on small stand-in SGLang trees (written here; they replace the released
wheels, which the docs' table was made from): it finds every entry into the piecewise forward context with
its enclosing function, where decode batches go, and calls decode reachable only when a decode path enters it."""

from __future__ import annotations

import pathlib
import textwrap
import zipfile

import pytest
from project_scripts import load_script

audit_module = load_script("sglang_piecewise_audit")

PCM = """
_forward_context = None
def get_forward_context():
    return _forward_context
def set_forward_context(forward_batch):
    ...
"""
PIECEWISE = """
from sglang.srt.compilation.piecewise_context_manager import set_forward_context
class PiecewiseCudaGraphRunner:
    def replay(self, forward_batch):
        with set_forward_context(forward_batch):
            return 1
"""
MODEL_RUNNER = """
class ModelRunner:
    def forward_decode(self, forward_batch):
        return self.model.forward(forward_batch){decode_extra}
    def forward_extend(self, forward_batch):
        if self.piecewise_cuda_graph_runner.can_run(forward_batch):
            return self.piecewise_cuda_graph_runner.replay(forward_batch)
    def _forward_raw(self, forward_batch):
        if forward_batch.forward_mode.is_decode():
            ret = self.forward_decode(forward_batch)
        elif forward_batch.forward_mode.is_extend():
            ret = self.forward_extend(forward_batch)
        return ret
"""


def _tree(root: pathlib.Path, decode_extra: str = "", graph_runner: str = "class CudaGraphRunner:\n    pass\n",
          pcm: bool = True) -> pathlib.Path:
    files = {"sglang/srt/model_executor/piecewise_cuda_graph_runner.py": PIECEWISE,
             "sglang/srt/model_executor/model_runner.py": MODEL_RUNNER.format(decode_extra=decode_extra),
             "sglang/srt/model_executor/cuda_graph_runner.py": graph_runner}
    if pcm:
        files["sglang/srt/compilation/piecewise_context_manager.py"] = PCM
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_a_context_entered_only_by_the_extend_graph_runner_is_never_set_in_decode(tmp_path: pathlib.Path) -> None:
    report = audit_module.audit(_tree(tmp_path / "t"), "0.5.9")
    assert report["piecewise_context_manager"] and report["version"] == "0.5.9"
    assert report["set_forward_context"] == [{"file": "sglang/srt/model_executor/piecewise_cuda_graph_runner.py",
                                              "line": 5, "function": "PiecewiseCudaGraphRunner.replay"}]
    assert {(c["function"], c["method"]) for c in report["piecewise_runner_calls"]} == {
        ("ModelRunner.forward_extend", "can_run"), ("ModelRunner.forward_extend", "replay")}
    assert "self.forward_decode" in report["dispatch"]["decode"]
    assert "self.forward_extend" in report["dispatch"]["extend"]
    assert not report["decode_sets_it"] and report["verdict"] == "never set during a decode forward"


def test_any_decode_entry_is_found(tmp_path: pathlib.Path) -> None:
    extra = "\n        self.piecewise_cuda_graph_runner.replay(forward_batch)"
    decode_runner = audit_module.audit(_tree(tmp_path / "a", decode_extra=extra))
    assert decode_runner["decode_sets_it"] and "model_runner.py:5" in decode_runner["verdict"]
    capture = ("from sglang.srt.compilation.piecewise_context_manager import set_forward_context\n"
               "class CudaGraphRunner:\n    def capture(self, batch):\n        with set_forward_context(batch):\n"
               "            pass\n")
    in_graph = audit_module.audit(_tree(tmp_path / "b", graph_runner=capture))
    assert in_graph["decode_sets_it"] and "cuda_graph_runner.py:4" in in_graph["verdict"]
    absent = audit_module.audit(_tree(tmp_path / "c", pcm=False))
    assert absent["verdict"] == "module absent"


def test_wheels_are_read_with_their_release_and_the_table_lists_every_site(tmp_path: pathlib.Path, capsys) -> None:
    tree = _tree(tmp_path / "tree")
    wheel = tmp_path / "sglang-0.5.13.post1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in tree.rglob("*.py"):
            archive.write(path, path.relative_to(tree).as_posix())
    assert audit_module.main([str(wheel)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| 0.5.13.post1 | yes | `model_executor/piecewise_cuda_graph_runner.py:5` "
                               "PiecewiseCudaGraphRunner.replay |")
    assert table[2].endswith("| never set during a decode forward |")
    with pytest.raises(SystemExit):
        audit_module.main([str(tmp_path / "missing.whl")])
