"""The plugin system: discovery, engine choice, failure isolation, third-party packages.

A broken plugin must be reported by name and leave TorchLens working; a package that
declares an entry point in group ``torchlens`` must be found without any registration call
(``tests/fixtures/thirdparty_plugin`` is pip-installed into this environment to show it).
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import torchlens as tl
from torchlens import hookspecs
from torchlens.capture.request import CaptureRequest
from torchlens.core.selectors import ModuleOutput
from torchlens.errors import InvalidArgumentError, PluginError, SiteNotFoundError
from torchlens.hookspecs import hookimpl

plugins = importlib.import_module("torchlens.plugins")  # the module; tl.plugins is the listing function
ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "thirdparty_plugin"
IDS = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture
def fresh():
    """A plugin manager rediscovered from the entry points, and again afterwards."""
    plugins.reload()
    yield
    plugins.reload()


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)).eval()


def _plain_mlp(model: nn.Module) -> torch.Tensor:
    seen = []
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        handle.remove()
    return seen[0]


# -- listing -------------------------------------------------------------------------------


def test_builtins_are_listed_as_plugins(fresh):
    listed = {p.name: p for p in tl.plugins()}
    expected = {"torchlens:engine_hooks": "engine", "torchlens:engine_function_mode": "engine",
                "torchlens:adapters_builtin": "adapter", "torchlens:helpers_builtin": "helpers"}
    for name, kind in expected.items():
        info = listed[name]
        assert kind in info.kind.split("+")
        assert (info.version, info.origin, info.error) == (tl.__version__, "torchlens", None)
    assert set(plugins.engines()) >= {"hooks", "function_mode"}
    assert {a.name for a in plugins.adapters()} >= {"gpt2", "gpt_neox", "llama", "gemma3_text", "bert", "generic"}


def test_adapters_are_only_reached_through_the_plugin_manager():
    """No core module imports an adapter: they come in through the entry point."""
    imports = re.compile(r"^\s*(from|import)\s+(torchlens_adapters|adapters)\b", re.M)
    for path in (ROOT / "torchlens").rglob("*.py"):
        assert not imports.search(path.read_text()), path


# -- engine choice -------------------------------------------------------------------------


def test_engine_choice_by_default(gpt2):
    modules_only = CaptureRequest(gpt2, (IDS,), {}, record_ops=False, sites=ModuleOutput("transformer.h.0"))
    every_op = CaptureRequest(gpt2, (IDS,), {}, record_ops=True)
    assert plugins.choose_engine(modules_only, None).name == "hooks"
    assert plugins.choose_engine(every_op, None).name == "function_mode"
    assert tl.trace(gpt2, IDS).engine == "function_mode"


def test_engine_choice_by_name(gpt2):
    trace = tl.trace(gpt2, IDS, backend="hooks", intervene=tl.when("blocks.1.mlp", tl.scale(1.0)))
    assert trace.engine == "hooks"
    assert torch.equal(trace["blocks.1.mlp"].out, _plain_mlp(gpt2))
    with pytest.raises(InvalidArgumentError, match="no capture engine named 'nope'") as info:
        tl.trace(gpt2, IDS, backend="nope")
    assert "hooks" in str(info.value) and "function_mode" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="cannot serve"):
        tl.trace(gpt2, IDS, backend="hooks", intervene=tl.when(tl.func("softmax"), 0.0))


class CountingEngine:
    """Serves module-only requests more cheaply than the built-in hooks engine."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def cost(self, request):
        return 0.5 if request.module_only() and not request.record_ops else None

    def capture(self, request):
        self.calls += 1
        trace = plugins.engines()["hooks"].capture(request)
        trace.engine = self.name
        return trace


def test_a_registered_engine_is_chosen_by_cost_and_by_name(fresh, gpt2):
    engine = CountingEngine()

    class P:
        @hookimpl
        def torchlens_engines(self):
            return [engine]

    plugins.register(P(), name="counting-plugin")
    got = tl.extract(gpt2, IDS, ["blocks.1.mlp"])["blocks.1.mlp"]
    assert engine.calls == 1 and torch.equal(got, _plain_mlp(gpt2))
    assert plugins.builtin_engines_only() is False
    got = tl.extract(gpt2, IDS, ["transformer.h.1.mlp"])["transformer.h.1.mlp"]  # a module's own address too
    assert engine.calls == 2 and torch.equal(got, _plain_mlp(gpt2))
    assert tl.trace(gpt2, IDS).engine == "function_mode"  # it cannot serve every-op requests
    with pytest.raises(InvalidArgumentError, match="cannot serve"):
        tl.trace(gpt2, IDS, backend="counting")
    assert any(p.name == "counting-plugin" and p.kind == "engine" for p in tl.plugins())
    plugins.unregister(name="counting-plugin")
    tl.extract(gpt2, IDS, ["blocks.1.mlp"])
    assert engine.calls == 2 and plugins.builtin_engines_only() is True


# -- failure isolation -------------------------------------------------------------------------


def _broken(listed, name):
    return next(p for p in listed if p.name == name and p.error)


def test_a_raising_engines_hook_is_reported_and_skipped(fresh, gpt2):
    class Bad:
        @hookimpl
        def torchlens_engines(self):
            raise RuntimeError("engine plugin exploded")

    plugins.register(Bad(), name="bad-engines")
    with pytest.warns(UserWarning, match="bad-engines.*engine plugin exploded"):
        assert {"hooks", "function_mode"} <= set(plugins.engines())
    assert "engine plugin exploded" in _broken(tl.plugins(), "bad-engines").error
    assert tl.trace(gpt2, IDS).engine == "function_mode"
    plugins.unregister(name="bad-engines")
    assert all(p.name != "bad-engines" for p in tl.plugins())


def test_a_raising_adapter_chooser_does_not_break_arch(fresh, gpt2):
    class BadChooser:
        @hookimpl
        def torchlens_choose_adapter(self, model):
            raise ValueError("chooser bug")

    plugins.register(BadChooser(), name="bad-chooser")
    with pytest.warns(UserWarning, match="bad-chooser.*chooser bug"):
        assert tl.arch(gpt2).adapter == "gpt2"
    assert "chooser bug" in _broken(tl.plugins(), "bad-chooser").error
    assert torch.equal(tl.trace(gpt2, IDS)["blocks.1.mlp"].out, _plain_mlp(gpt2))


def test_a_raising_adapter_fails_only_its_own_models(fresh, gpt2):
    class Config:
        model_type = "exploding_family"

    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    class BadAdapter:
        name = "exploding"
        model_types = ("exploding_family",)

        def view(self, model):
            raise KeyError("adapter bug")

    class P:
        @hookimpl
        def torchlens_adapters(self):
            return [BadAdapter()]

    plugins.register(P(), name="bad-adapter")
    model = Exploding()
    with pytest.warns(UserWarning, match="bad-adapter"), pytest.raises(PluginError, match="bad-adapter") as info:
        tl.arch(model)
    assert "adapter bug" in str(info.value)
    assert tl.arch(gpt2).adapter == "gpt2"  # other models are unaffected
    trace = tl.trace(model, torch.ones(1, 2))  # and the broken family can still be captured
    assert torch.equal(trace["layers.1"].out, model(torch.ones(1, 2)))
    with pytest.raises(SiteNotFoundError):
        trace.find_sites(tl.module("blocks.1"))


def test_a_raising_facet_plugin_is_skipped(fresh, gpt2):
    class BadFacets:
        @hookimpl(tryfirst=True)
        def torchlens_facets(self, site):
            raise RuntimeError("facet bug")

    plugins.register(BadFacets(), name="bad-facets")
    site = tl.trace(gpt2, IDS)["transformer.h.0.mlp.c_fc"]
    with pytest.warns(UserWarning, match="bad-facets.*facet bug"), pytest.raises(SiteNotFoundError):
        _ = site.facets
    assert "facet bug" in _broken(tl.plugins(), "bad-facets").error


def test_duplicate_and_misspelt_plugins_are_reported(fresh):
    class Impostor:
        name = "hooks"

        def cost(self, request):
            return 0.0

        def capture(self, request):
            raise AssertionError("never used")

    class Dup:
        @hookimpl
        def torchlens_engines(self):
            return [Impostor()]

    class Typo:
        @hookimpl
        def torchlens_engine(self):  # not a hook: should be torchlens_engines
            return []

    with pytest.warns(UserWarning, match="unknown hook 'torchlens_engine'"):
        plugins.register(Typo(), name="typo-plugin")
    plugins.register(Dup(), name="dup-plugin")
    with pytest.warns(UserWarning, match="dup-plugin.*already registered"):
        engine = plugins.engines()["hooks"]
    assert type(engine).__name__ == "HooksEngine"


def test_a_plugin_that_fails_to_import_is_reported(fresh, tmp_path, monkeypatch, gpt2):
    dist = tmp_path / "broken_fixture_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-fixture-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[torchlens]\nbroken = tl_broken_fixture_module:plugin\n")
    (tmp_path / "tl_broken_fixture_module.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.reload()
    with pytest.warns(UserWarning, match="broken-fixture-plugin:broken.*a_dependency_that_is_not_installed"):
        listed = tl.plugins()
    info = _broken(listed, "broken-fixture-plugin:broken")
    assert (info.kind, info.version, info.origin) == ("broken", "1.0", "broken-fixture-plugin")
    assert "ModuleNotFoundError" in info.error
    assert tl.arch(gpt2).n_layers == 2
    assert torch.equal(tl.trace(gpt2, IDS)["blocks.1.mlp"].out, _plain_mlp(gpt2))


# -- hookspecs and their documentation ---------------------------------------------------------


def _hooks() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("torchlens_"))


def test_every_hook_states_its_dispatch_rule():
    assert _hooks() == ["torchlens_adapters", "torchlens_choose_adapter", "torchlens_engines", "torchlens_facets",
                        "torchlens_helpers"]
    for name in _hooks():
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "Called" in doc and re.search(r"first non-None|collected", doc), name


def test_every_hook_is_documented_for_plugin_authors():
    page = (ROOT / "docs" / "plugins.md").read_text()
    for name in _hooks():
        assert f"`{name}" in page, f"{name} is missing from docs/plugins.md"


# -- a third-party package -------------------------------------------------------------------------

CHECK = textwrap.dedent(
    """
    import json, torch, torchlens as tl
    from torchlens_fixture_plugin import TinyNet
    torch.manual_seed(0)
    model = TinyNet().eval()
    ids = torch.tensor([[1, 2, 3]])
    view = tl.arch(model)
    trace = tl.trace(model, ids, backend="fixture_timed")
    plain = tl.trace(model, ids)
    with torch.no_grad():
        h = model.embed(ids)
        mid = h + torch.tanh(model.trunk[0].mix(h))
    print(json.dumps({
        "plugins": [[p.name, p.kind, p.version, p.origin] for p in tl.plugins()],
        "adapter": view.adapter, "n_heads": view.n_heads, "head_dim": view.head_dim,
        "engine": trace.engine, "timed": trace.capture_seconds > 0,
        "same": torch.equal(trace.output, plain.output),
        "mid": torch.equal(trace.find_sites(tl.module("blocks.0.resid_mid")).first().out, mid),
        "mlp": torch.equal(trace["blocks.1.mlp"].out, plain["trunk.1.ff"].out),
    }))
    """
)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def installed_fixture(tmp_path_factory):
    """The fixture distribution installed into this environment, and uninstalled afterwards."""
    src = tmp_path_factory.mktemp("plugin") / "thirdparty_plugin"
    shutil.copytree(FIXTURE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(src))
    try:
        yield
    finally:
        _pip("uninstall", "-y", "-q", "torchlens-fixture-plugin")
        plugins.reload()


def test_an_installed_package_is_discovered_without_registration(installed_fixture):
    env = dict(os.environ, TORCHLENS_TRACE_HOOKS="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180, env=env,
                          cwd=str(ROOT / "tests"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    listed = {name: (set(kind.split("+")), version, origin) for name, kind, version, origin in got["plugins"]}
    assert listed["torchlens-fixture-plugin:fixture"] == ({"adapter", "engine"}, "0.3.1", "torchlens-fixture-plugin")
    assert (got["adapter"], got["n_heads"], got["head_dim"]) == ("fixture_tiny", 2, 4)
    assert (got["engine"], got["timed"], got["same"], got["mid"], got["mlp"]) == ("fixture_timed", True, True, True,
                                                                                   True)
    assert "torchlens_engines" in proc.stderr  # TORCHLENS_TRACE_HOOKS printed the hook calls


def test_an_installed_package_is_discovered_in_process_after_reload(installed_fixture):
    plugins.reload()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean plugin loads without a single warning
        assert "fixture_timed" in plugins.engines()
    from torchlens_fixture_plugin import TinyNet

    model = TinyNet().eval()
    assert tl.arch(model).adapter == "fixture_tiny"
    assert tl.trace(model, torch.tensor([[1, 2]]), backend="fixture_timed").engine == "fixture_timed"
