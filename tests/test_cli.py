"""The torchlens command line: every subcommand on real saved traces, exit codes, typed errors.

Most tests call ``cli.main(argv)`` in-process (fast); one runs ``python -m torchlens`` and the
installed ``torchlens`` script in a subprocess to prove both entry points exist.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import SmallMLP

import torchlens as tl
from torchlens import cli


@pytest.fixture
def saved(tmp_path, small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    trace.save(tmp_path / "a")
    trace.fork("z").do("fc1", tl.zero_ablate()).save(tmp_path / "b")
    trace.fork("z").do("fc1", tl.zero_ablate()).save_intervention(tmp_path / "r.tlspec")
    return tmp_path, trace


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_version_and_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchlens", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"torchlens {metadata.version('torchlens')} (TorchLens")
    script = Path(sys.executable).with_name("torchlens")
    if not script.exists():
        script = shutil.which("torchlens")
    assert script, "the torchlens console script is not installed (pip install -e .)"
    proc = subprocess.run([str(script), "plugins"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0].split() == ["NAME", "KIND", "VERSION", "ORIGIN"]
    assert {p.name for p in tl.plugins()} <= {line.split()[0] for line in proc.stdout.splitlines()[1:]}


def test_version_says_which_torchlens_and_where_it_is(capsys):
    # PyPI's "torchlens" is a different, older project: --version names this one and the directory it runs from
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    first, where = capsys.readouterr().out.splitlines()
    assert first.startswith(f"torchlens {metadata.version('torchlens')} (TorchLens: read, edit, replay")
    assert "not the older PyPI project named torchlens" in first
    assert where == f"imported from {Path(tl.__file__).parent}"


def test_every_subcommand_has_help_without_rst_backticks(capsys):
    for command in ("inspect", "diff", "draw", "validate", "plugins", "demo"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "``" not in out and "exit codes:" in out and len(out) > 200
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in ("inspect", "diff", "draw", "validate", "plugins", "demo"))


def test_inspect_a_saved_trace_and_a_recipe(capsys, saved):
    path, trace = saved
    code, out, _ = run(capsys, "inspect", path / "a")
    assert code == 0
    assert "SmallMLP" in out and f"{len(trace.ops)} ops" in out
    for op in trace.ops:
        assert op.label in out
    params = sum(p.numel() for p in trace.model.fc1.parameters())  # 4*6 + 6, counted from the model
    fc1_row = next(line for line in out.splitlines() if line.split()[:2] == ["fc1", "Linear"])
    assert fc1_row.split()[3] == str(params) and "memory held" in out
    code, out, _ = run(capsys, "inspect", path / "r.tlspec")
    assert code == 0 and "1 step(s)" in out and "zero_ablate" in out and "fc1" in out


def test_diff_exit_codes(capsys, saved):
    path, _ = saved
    code, out, _ = run(capsys, "diff", path / "a", path / "a")
    assert code == 0 and "no differences" in out
    code, out, _ = run(capsys, "diff", path / "a", path / "b")
    assert code == 1 and "first divergence" in out and "fc1" in out


def test_draw_writes_the_picture(capsys, saved):
    path, trace = saved
    code, out, _ = run(capsys, "draw", path / "a", "-o", path / "g.dot", "--depth", "all")
    assert code == 0 and (path / "g.dot").exists()
    dot = (path / "g.dot").read_text()
    assert all(f'"{op.label}"' in dot for op in trace.ops)
    if shutil.which("dot"):
        code, _, _ = run(capsys, "draw", path / "a", "-o", path / "g.svg")
        assert code == 0 and (path / "g.svg").read_text().lstrip().startswith(("<?xml", "<svg", "<!--"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["draw", str(path / "a"), "-o", str(path / "x.svg"), "--depth", "zero"])
    assert exit_info.value.code == 2


FACTORY = """
import torch
from conftest import SmallMLP

def build():
    torch.manual_seed(0)
    return SmallMLP().eval()

def other():
    torch.manual_seed(1)
    return SmallMLP().eval()

def not_a_model():
    return 3
"""


def test_validate_with_a_model_factory(capsys, tmp_path, mlp_input, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent(FACTORY))
    torch.manual_seed(0)
    model = SmallMLP().eval()
    tl.trace(model, mlp_input).save(tmp_path / "t")
    code, out, _ = run(capsys, "validate", tmp_path / "t")
    assert code == 0 and "validate: OK" in out
    code, out, _ = run(capsys, "validate", tmp_path / "t", "--model", f"{factory}:build")
    assert code == 0 and "no differences" in out
    code, out, _ = run(capsys, "validate", tmp_path / "t", "--model", f"{factory}:other")  # other weights
    assert code == 1 and "first divergence" in out
    code, _, err = run(capsys, "validate", tmp_path / "t", "--model", f"{factory}:not_a_model")
    assert code == 3 and "nn.Module" in err and "Traceback" not in err
    code, _, err = run(capsys, "validate", tmp_path / "t", "--model", "no_such_module_xyz:build")
    assert code == 3 and "remedy:" in err


def test_errors_print_message_and_remedy_not_a_traceback(capsys, saved):
    path, _ = saved
    code, out, err = run(capsys, "inspect", path / "missing")
    assert code == 3 and "error:" in err and "remedy:" in err and "Traceback" not in err
    code, _, err = run(capsys, "diff", path / "a", path / "r.tlspec")
    assert code == 3 and "recipe" in err and "remedy:" in err
    (path / "a" / "manifest.json").write_text("{not json")
    code, _, err = run(capsys, "draw", path / "a", "-o", path / "g.svg")
    assert code == 3 and "remedy:" in err and not (path / "g.svg").exists()


def test_demo_runs(capsys):
    code, out, _ = run(capsys, "demo")
    assert code == 0 and "validate: OK" in out and "replayed fork == real forward with the edit: True" in out


def test_inspect_select_prints_only_the_selection_or_the_nearest_names(capsys, saved, tiny_gpt2, tmp_path):
    path, trace = saved
    code, out, err = run(capsys, "inspect", path / "a", "--select", "fc1")
    fc1_ops = [op.label for op in trace.ops if op.module == "fc1"]
    listed = [line.split()[0] for line in out.splitlines()[2:]]
    assert code == 0 and listed == fc1_ops and "memory held" not in out and "SmallMLP" not in out
    code, out, err = run(capsys, "inspect", path / "a", "--select", "fc9")
    assert code == 3 and out == "" and "nearest" in err and "'fc1'" in err and "'fc2'" in err
    # a module selection counts its ops, not its one site, when the listing is cut
    gpt = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    gpt.save(tmp_path / "g")
    block_ops = [op.label for op in gpt.ops if (op.module or "").startswith(("transformer.h.0.", "transformer.h.0:"))
                 or op.module == "transformer.h.0"]
    code, out, _ = run(capsys, "inspect", tmp_path / "g", "--select", "transformer.h.0", "--limit", "2")
    assert code == 0 and f"... {len(block_ops) - 2} more op(s)" in out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == block_ops[:2]
