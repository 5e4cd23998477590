"""The conformance kit (``torchlens.testing``): what it checks, that it fails where a model or an
adapter does not conform, and the template package in ``examples/`` built as a wheel and tested from
the outside, as a third-party package's CI runs it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import LinearToyLM, OwnRandom, assert_model_clean, hook_state

import torchlens as tl
from torchlens.arch import Layout, ResidualAdd
from torchlens.errors import InvalidArgumentError, SiteNotFoundError
from torchlens.hookspecs import hookimpl
from torchlens.plugins import register, unregister
from torchlens.testing import ConformanceReport, check_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "examples" / "torchlens-arch-template"


def test_a_conforming_family_passes_every_check(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    before = hook_state(model)
    report = check_model(model, ids, adapter="gpt2")
    assert isinstance(report, ConformanceReport) and report.ok, report.summary()
    assert report.names() == [
        "capture equals a plain forward", "capture leaves the model unchanged", "validate", "adapter is 'gpt2'",
        "declared canonical sites are found", "site blocks.0.resid_post == blocks.1.resid_pre",
        "site blocks.0.attn has resid_pre's size (192)", "site blocks.0.mlp has resid_pre's size (192)",
        "site blocks.1.attn has resid_pre's size (192)", "site blocks.1.mlp has resid_pre's size (192)",
        "site blocks.0.resid_mid == blocks.0.resid_pre + blocks.0.attn",
        "site blocks.1.resid_mid == blocks.1.resid_pre + blocks.1.attn",
        "replay blocks.0.mlp", "replay blocks.1.mlp", "facets blocks.0.attn", "facets blocks.1.attn"]
    replay = {r.name: r.detail for r in report.results}["replay blocks.1.mlp"]
    assert replay.startswith("max abs error 0 ") and "transformer.h.1.mlp" in replay
    assert report.assert_ok() is report and report.summary().splitlines()[0].endswith("OK")
    assert_model_clean(model, before)


class WrongAdapter:
    """Declares ``resid_mid`` as the block's second add (its output), which is not ``resid_pre + attn``."""

    name = "wrongtoy"

    def view(self, model):
        layout = Layout(blocks="blocks", attn="attn", mlp="mlp", resid_mid=ResidualAdd(2), embed="embed",
                        embed_out="embed", unembed="lm_head")
        return layout.view(model, self.name, n_heads=1, n_kv_heads=1, head_dim=8, d_model=8)


class WrongPlugin:
    @hookimpl
    def torchlens_choose_adapter(self, model):
        return WrongAdapter() if isinstance(model, LinearToyLM) else None


@pytest.fixture
def wrong_adapter():
    plugin = WrongPlugin()
    register(plugin, name="wrong-toy-adapter")
    yield
    unregister(plugin)


def test_an_adapter_that_misplaces_a_site_fails_its_structural_check(wrong_adapter, linear_toy):
    model, (ids,) = linear_toy.model, linear_toy.args
    report = check_model(model, ids, adapter="wrongtoy")
    assert not report.ok
    failed = [r.name for r in report.failures]
    assert failed == [f"site blocks.{i}.resid_mid == blocks.{i}.resid_pre + blocks.{i}.attn" for i in range(3)]
    assert {r.name for r in report.results if r.passed} >= {"validate", "replay blocks.0.mlp", "replay blocks.2.mlp"}
    with pytest.raises(AssertionError, match=r"3 of \d+ checks FAILED[\s\S]*FAIL site blocks.0.resid_mid"):
        report.assert_ok()


def test_the_adapter_check_names_the_adapter_that_serves_instead(linear_toy):
    model, (ids,) = linear_toy.model, linear_toy.args
    report = check_model(model, ids, adapter="wrongtoy", checks=("adapter",))
    assert [(r.name, r.passed) for r in report.results] == [("adapter is 'wrongtoy'", False)]
    assert "'generic'" in report.results[0].detail


def test_a_random_forward_fails_capture_and_validate_naming_the_randomness():
    torch.manual_seed(0)
    model = OwnRandom().eval()
    x = torch.randn(2, 8)
    report = check_model(model, x, edit_sites=["mlp"], checks=("capture", "validate", "replay"))
    rows = {r.name: r for r in report.results}
    assert not rows["capture equals a plain forward"].passed
    assert "draws random numbers" in rows["capture equals a plain forward"].detail
    assert not rows["validate"].passed and "NOT FULLY CHECKED" in rows["validate"].detail
    assert not rows["replay mlp"].passed and "ReplayNotExactError" in rows["replay mlp"].detail


def test_an_edit_site_that_is_an_op_or_changes_nothing_fails_by_name(linear_toy):
    model, (ids,) = linear_toy.model, linear_toy.args
    trace = tl.trace(model, ids)
    op = trace.find_sites(tl.func("add")).first().label
    report = check_model(model, ids, edit_sites=[op, "blocks.0.attn"], checks=("replay",))
    rows = {r.name: r for r in report.results}
    assert not rows[f"replay {op}"].passed and "is an op, not a module output" in rows[f"replay {op}"].detail
    assert rows["replay blocks.0.attn"].passed


def test_bad_input_raises_named_errors_and_leaves_the_model_unchanged(linear_toy):
    model, (ids,) = linear_toy.model, linear_toy.args
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError, match="takes an nn.Module") as err:
        check_model("gpt2", ids)
    assert err.value.remedy
    with pytest.raises(InvalidArgumentError, match="unknown kinds") as err:
        check_model(model, ids, checks=("capture", "speed"))
    assert "replay" in err.value.remedy
    with pytest.raises(SiteNotFoundError, match="blocks.9.mlp"):
        check_model(model, ids, edit_sites=["blocks.9.mlp"], checks=("replay",))
    assert_model_clean(model, before)


# -- the template package, built and tested from the outside --------------------------------------------


def _run(*args: str, env: dict | None = None, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_template_package_builds_and_its_tests_pass_from_the_outside(tmp_path):
    """The template is built as a wheel (from a copy: an in-tree build leaves ``build/`` behind), installed
    into a directory of its own with pip, and its tests run from a directory holding only them: its
    adapter comes through the entry point alone, and the conformance kit passes on each configuration."""
    src, wheels, site, run = (tmp_path / d for d in ("src", "wheels", "site", "run"))
    shutil.copytree(TEMPLATE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = ("-m", "pip", "-q", "--disable-pip-version-check")
    _run(*pip[:2], "wheel", *pip[2:], "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src))
    (wheel,) = wheels.glob("torchlens_arch_template-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert "[torchlens]\ntoyarch = torchlens_arch_template:plugin" in zf.read(entry_points).decode()
    _run(*pip[:2], "install", *pip[2:], "--no-deps", "--no-index", "--target", str(site), str(wheel))
    shutil.copytree(TEMPLATE / "tests", run / "tests")
    # torchlens as this test imports it (the checkout under test), the template from its install only
    roots = {str(pathlib.Path(m.__file__).resolve().parents[1]) for m in (tl, sys.modules["torchlens_adapters"])}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sorted(roots)]), "HF_HUB_OFFLINE": "1"}
    proc = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(run / "tests"), env=env, cwd=run)
    assert "5 passed" in proc.stdout, proc.stdout
