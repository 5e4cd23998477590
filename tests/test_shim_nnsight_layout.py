"""torchlens_shims.nnsight at nnsight 0.8's module paths, eproperty, memory, refusals, packaging.

nnsight code ports by changing ``nnsight`` to ``torchlens_shims.nnsight`` in its imports, so
every public module path of nnsight that user code imports from exists in the shim and hands
out the shim's own objects (never a second copy). Values are compared with plain
``register_forward_hook`` reads and edits of the same model.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torchlens_shims.nnsight as nnsight
from torch import nn
from torchlens_shims.nnsight import errors
from torchlens_shims.nnsight.intervention.envoy import Envoy
from torchlens_shims.nnsight.intervention.eproperty import eproperty
from torchlens_shims.nnsight.util import apply

from torchlens.errors import OptionalDependencyError, ShimUnsupportedError

# nnsight module path -> (names user code imports from it, the shim modules that own them)
LAYOUT = {
    "modeling.transformers": (["TransformersModel"], "modeling.transformers"),
    "modeling.language": (["LanguageModel"], "modeling.transformers"),
    "modeling.base": (["NNsight"], "envoy"),
    "modeling.processing": (["batch_forward", "collate"], "processing"),
    "modeling.vllm": (["VLLM"], "_unsupported"),
    "intervention.envoy": (["Envoy", "traceable"], "envoy"),
    "intervention.eproperty": (["eproperty"], "_served"),
    "intervention.aliasing": (["bind", "named", "spellings", "path_ends_with"], "aliasing"),
    "modeling.huggingface": (["HuggingFaceModel"], "modeling.huggingface"),
    "intervention.interleaver": (["EarlyStopException", "OutOfOrderError", "Event", "Pending"], "interleaver"),
    "intervention.tracer": (["InterleavingTracer", "Invoker", "Tracer"], "tracer"),
    "intervention.iterator": (["Iterations"], "tracer"),
    "intervention.editing": (["EditingTracer"], "tracer"),
    "intervention.barrier": (["Barrier"], "barrier"),
    "intervention.batching": (["Batcher"], "batching"),
    "intervention.backward": (["BackwardTracer"], "backward"),
    "intervention.cache": (["Cache", "CacheView"], "cache"),
    "intervention.errors": (["OutOfOrderError", "WithBlockNotFoundError"], "errors"),
    "intervention.source": (["SourceNotAvailable", "STATE"], "source"),
    "intervention.util": (["apply"], "util"),
    "tracing.tracer": (["Tracer", "WithBlockNotFoundError", "ExitTracingException", "save"], "tracer errors _saving"),
    "tracing.util": (["clean_traceback", "push"], "tracer"),
    "tracing.backend": (["Backend"], "_unsupported"),
    "schema.config": (["CONFIG", "Config"], "_unsupported"),
    "ndif": (["status", "login", "whoami", "is_model_running", "ndif_status"], "_unsupported"),
    "util": (["apply", "from_import_path", "to_import_path"], "util"),
}


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Raises(TwoLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a(x)
        raise RuntimeError("boom")


def seeded_model(cls: type = TwoLayer) -> nn.Module:
    torch.manual_seed(0)
    return cls()


X = torch.arange(16.0).reshape(2, 8) / 16


@pytest.mark.parametrize("path", LAYOUT)
def test_every_nnsight_module_path_imports_the_shims_own_objects(path):
    names, owners = LAYOUT[path]
    module = importlib.import_module(f"torchlens_shims.nnsight.{path}")
    homes = [vars(importlib.import_module(f"torchlens_shims.nnsight.{owner}")) for owner in owners.split()]
    for name in names:
        assert any(getattr(module, name) is home.get(name) for home in homes), f"{path}.{name}"
    assert set(names) <= set(module.__all__)


# -- eproperty ------------------------------------------------------------------------------


class Halves(Envoy):
    """A [B, 8] output read as [B, 2, 4]; edits to the view are written back."""

    @eproperty(key="output")
    def halves(self, value):
        return value.view(value.shape[0], 2, 4)

    @halves.transform
    def halves(self, view, raw):
        return view.reshape(view.shape[0], 8)


class Doubled(Envoy):
    @eproperty(key="output", description="twice the output")
    def doubled(self, value):
        return value * 2

    @doubled.postprocess
    def doubled(self, value):
        return value / 2


def plain_edit(model: nn.Module, module: nn.Module, edit) -> torch.Tensor:
    handle = module.register_forward_hook(lambda m, args, out: edit(out.clone()))
    try:
        with torch.no_grad():
            return model(X)
    finally:
        handle.remove()


def test_eproperty_view_edit_is_written_back_like_a_hook_edit():
    net = seeded_model()
    model = nnsight.NNsight(net, envoys={nn.Linear: Halves})
    assert type(model.a) is Halves
    with torch.no_grad(), model.trace(X):
        model.a.halves[:, 1] = 0
        first = model.a.halves.save()
        same = model.a.halves.save()  # a second read before the write-back is the same view
        out = model.output.save()
    assert first is same

    def zero_second_half(h):
        h[:, 4:] = 0
        return h

    assert torch.equal(out, plain_edit(net, net.a, zero_second_half))


def test_eproperty_read_and_postprocessed_write():
    net = seeded_model()
    model = nnsight.NNsight(net, envoys={nn.Linear: Doubled})
    with torch.no_grad(), model.trace(X):
        seen = model.a.doubled.save()
        model.a.doubled = torch.ones(2, 8)  # postprocess halves it on the way in
        out = model.output.save()
    with torch.no_grad():
        assert torch.equal(seen, net.a(X) * 2)
        assert torch.equal(out, net.b(torch.full((2, 8), 0.5)))
    assert str(Doubled.doubled) == "(doubled): twice the output"


def test_eproperty_outside_a_trace_raises_not_interleaving():
    model = nnsight.NNsight(seeded_model(), envoys={nn.Linear: Halves})
    with pytest.raises(errors.NotInterleavingError):
        model.a.halves  # noqa: B018
    with torch.no_grad(), model.trace(X):  # nothing was lost: the model still traces
        out = model.output.save()
    assert out.shape == (2, 8)


# -- util.apply (nnsight.util.apply) ------------------------------------------------------


def test_apply_walks_containers_and_descends_objects_to_depth_n():
    class Holder:
        def __init__(self) -> None:
            self.t = torch.tensor(1.0)
            self.child = None

    data = {"a": [torch.tensor(1.0), (torch.tensor(2.0), 3)], "s": slice(torch.tensor(4.0), None)}
    out = apply(data, lambda t: t + 1, torch.Tensor)
    assert out["a"][0].item() == 2 and out["a"][1][0].item() == 3 and out["a"][1][1] == 3
    assert out["s"].start.item() == 5 and data["a"][0].item() == 1  # the original is untouched
    outer = Holder()
    outer.child = Holder()
    assert apply(outer, lambda t: t + 1, torch.Tensor) is outer and outer.t.item() == 1  # n=0: opaque
    apply([outer], lambda t: t + 1, torch.Tensor, n=1)
    assert outer.t.item() == 2 and outer.child.t.item() == 1


# -- memory: nothing of the model, the tracer or its values outlives a trace ---------------


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _traced(cls: type, read_child: bool = False):
    model = Envoy(seeded_model(cls))
    try:
        with model.trace(X) as tracer:
            out = model.b.output.save() if cls is TwoLayer else model.a.output.save()
    except RuntimeError:
        out = None
    kept = model.b if read_child else None
    return weakref.ref(model._module), weakref.ref(tracer), out, kept


@pytest.mark.parametrize("cls", [TwoLayer, Raises], ids=["trace", "forward-raises"])
def test_model_and_tracer_freed_by_refcount_after_a_trace(no_cyclic_gc, cls):
    module, tracer, out, _ = _traced(cls)
    assert module() is None and tracer() is None
    if cls is TwoLayer:
        net = seeded_model()
        with torch.no_grad():
            assert torch.allclose(out, net(X))


def test_model_freed_when_the_body_raises(no_cyclic_gc):
    def run():
        model = Envoy(seeded_model())
        with pytest.raises(ValueError):
            with model.trace(X) as tracer:
                raise ValueError("boom")
        return weakref.ref(model._module), weakref.ref(tracer)

    module, tracer = run()
    assert module() is None and tracer() is None


def test_a_held_child_envoy_does_not_hold_the_model(no_cyclic_gc):
    module, _, _, child = _traced(TwoLayer, read_child=True)
    assert module() is None and child.parent is None


def test_a_thousand_traces_hold_flat_memory(no_cyclic_gc):
    model = Envoy(seeded_model())

    def once():
        with torch.no_grad(), model.trace(X):
            model.b.output.save()

    for _ in range(20):  # warm caches (hook sets, compiled blocks)
        once()
    before = len(gc.get_objects())
    for _ in range(1000):
        once()
    assert len(gc.get_objects()) - before < 50  # no per-trace survivor (1,000 would be >= 1,000)


# -- out of scope: typed refusals ------------------------------------------------------------


def test_internals_and_remote_names_are_typed_refusals():
    from torchlens_shims.nnsight.intervention.interleaver import Interleaver, Mediator
    from torchlens_shims.nnsight.intervention.source import Controller
    from torchlens_shims.nnsight.modeling.vllm import VLLM
    from torchlens_shims.nnsight.ndif import login, status
    from torchlens_shims.nnsight.tracing.backend import Backend

    for internal in (Interleaver, Mediator, Controller, Backend):
        with pytest.raises(errors.InternalsUnsupportedError) as raised:
            internal()
        assert raised.value.remedy and isinstance(raised.value, ShimUnsupportedError)
    for remote in (status, login):
        with pytest.raises(errors.RemoteUnsupportedError):
            remote()
    with pytest.raises(errors.VLLMUnsupportedError):
        VLLM("gpt2")
    with pytest.warns(errors.NNsightDeprecationWarning, match=r"use nnsight\.status\(\)"):
        with pytest.raises(errors.RemoteUnsupportedError):
            nnsight.ndif_status()


def test_no_with_block_messages_tell_the_causes_apart(tmp_path):
    from torchlens_shims.nnsight.tracing.tracer import _not_found_message

    assert "python < script.py" in _not_found_message("<stdin>", 3)
    script = tmp_path / "traced.py"
    script.write_text("value = 1\n")
    message = _not_found_message(str(script), 1)
    assert f"{script}:1" in message and "stale" in message and "`value = 1`" in message
    with pytest.raises(errors.WithBlockNotFoundError, match="test_shim_nnsight_layout.py"):
        nnsight.NNsight(seeded_model()).trace(X).__enter__()


# -- packaging: a plain install says which extra to add ------------------------------------

BLOCK_TRANSFORMERS = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" or name.startswith("transformers."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Block())
    from torchlens.errors import OptionalDependencyError
    try:
        import torchlens_shims.nnsight
    except OptionalDependencyError as error:
        print("REMEDY", error.remedy)
    import torchlens_shims.baukit  # needs nothing beyond torch
    print("BAUKIT OK")
    """
)


def test_nnsight_shim_without_transformers_names_the_extra():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", BLOCK_TRANSFORMERS], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "REMEDY pip install 'torchlens[nnsight]'" in proc.stdout
    assert "BAUKIT OK" in proc.stdout
    assert issubclass(OptionalDependencyError, ImportError)


def test_shim_extras_declare_what_each_shim_imports():
    tomllib = pytest.importorskip("tomllib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)
    extras = project["project"]["optional-dependencies"]
    assert any(req.startswith("transformers") for req in extras["nnsight"])
    assert any(req.startswith("transformers") for req in extras["shims"])
    assert "baukit" in extras  # that the wheel holds every shim package: tests/test_packaging.py



# -- rename= aliases ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.mixer(x))


class Hybrid(nn.Module):
    """Blocks whose mixer is a Linear in some and a GELU-ed Linear stack in others."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(nn.Linear(8, 8)), Block(nn.Sequential(nn.Linear(8, 8), nn.GELU()))])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_rename_by_class_wildcard_and_leading_dot_serve_the_real_module():
    torch.manual_seed(0)
    net = Hybrid()
    model = Envoy(net, rename={nn.Sequential: "mlp", "*.1": "second", ".norm": "ln"})
    assert model.blocks[1].mlp is model.blocks[1].mixer and "mlp" not in model.blocks[0].__dict__
    assert model.second is model.blocks[1] and model.blocks[0].ln is model.blocks[0].norm
    with torch.no_grad(), model.trace(X):
        through_alias = model.blocks[1].mlp.output.save()
    reads = []
    handle = net.blocks[1].mixer.register_forward_hook(lambda m, a, out: reads.append(out.clone()))
    with torch.no_grad():
        net(X)
    handle.remove()
    assert torch.equal(through_alias, reads[0])


@pytest.mark.parametrize(
    "rename, words",
    [
        ({"head": "blocks"}, ["child module", "'blocks'"]),
        ({"head": "trace"}, ["Envoy.trace"]),
        ({"head": "output"}, ["Envoy.output"]),
        ({"head": "eval"}, ["module's own attribute"]),
        ({"head": "path"}, ["envoy's own state"]),
        ({"blocks": "dup", "head": "dup"}, ["already bound"]),
        ({nn.LayerNorm: "ln", "*.1": "x"}, []),  # fine: one LayerNorm per block
        ({nn.Linear: "lin"}, None),  # two Linears directly under `model` (none) ... see below
    ],
)
def test_rename_that_would_hide_a_name_raises_rename_error(rename, words):
    net = Hybrid()
    before = [name for name, _ in net.named_modules()]
    if words is None:
        net.extra = nn.Linear(8, 8)  # now `model` holds two Linears: head and extra
        with pytest.raises(errors.RenameError, match=r"matches 2 modules under `model` \(head, extra\)"):
            Envoy(net, rename=rename)
        return
    if not words:
        assert Envoy(net, rename=rename).blocks[0].ln is not None
        return
    with pytest.raises(errors.RenameError) as raised:
        Envoy(net, rename=rename)
    assert "rename" in str(raised.value) and all(word in str(raised.value) for word in words)
    assert isinstance(raised.value, ValueError)
    assert [name for name, _ in net.named_modules()] == before  # the model is untouched
    with torch.no_grad(), Envoy(net).trace(X):  # and still traces
        pass


# -- the out-of-scope list: one file, shown on the docs page ------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCOPE = os.path.join(ROOT, "shims", "torchlens_shims", "nnsight", "upstream_scope.tsv")
TARGETS = os.path.join(os.path.dirname(ROOT), "shared", "nnsight-upstream", "targets.txt")


def _scope_rows() -> list[list[str]]:
    with open(SCOPE, encoding="utf-8") as handle:
        return [line.rstrip("\n").split("\t") for line in handle if line.strip() and not line.startswith("#")]


def _gen_scope():
    path = os.path.join(ROOT, "docs", "gen_nnsight_scope.py")
    spec = importlib.util.spec_from_file_location("gen_nnsight_scope", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_section_lists_every_out_of_scope_row(tmp_path):
    gen = _gen_scope()
    text = gen.render()
    rows = _scope_rows()
    assert rows and all(len(row) == 3 and row[1] in gen.CATEGORIES for row in rows)
    for pattern, _, reason in rows:
        assert f"| `{pattern}` | {reason.replace('|', chr(92) + '|')} |" in text
    with open(os.path.join(ROOT, "docs", "coming-from-nnsight.md"), encoding="utf-8") as handle:
        assert gen.MARKER in handle.read()
    bad = tmp_path / "scope.tsv"
    bad.write_text("tests/x.py::*\tnot-a-category\twhy\n")
    with pytest.raises(ValueError, match="unknown category"):
        gen.render(bad)


@pytest.mark.skipif(not os.path.exists(TARGETS), reason="no ../shared/nnsight-upstream beside the repository")
def test_every_out_of_scope_row_names_upstream_targets():
    import fnmatch

    with open(TARGETS, encoding="utf-8") as handle:
        targets = [line.strip() for line in handle if line.strip()]
    for pattern, _, _ in _scope_rows():
        assert any(fnmatch.fnmatchcase(test, pattern) for test in targets), pattern


# -- your own model wrappers: Loadable / Meta ------------------------------------------------


def test_meta_builds_weightless_then_dispatches_real_weights_on_first_trace():
    from torchlens_shims.nnsight.modeling.mixins.loadable import Loadable
    from torchlens_shims.nnsight.modeling.mixins.meta import Meta

    class Lazy(Meta):
        def _load_meta(self, name):
            return TwoLayer()

        def _load(self, name):
            return seeded_model()

    model = Lazy("two-layer")
    assert model.dispatched is False and all(p.device.type == "meta" for p in model._module.parameters())
    with torch.no_grad(), model.trace(X):
        out = model.b.output.save()
    assert model.dispatched is True and model.a._module is model._module.a
    with torch.no_grad():
        assert torch.equal(out, seeded_model()(X))
    with pytest.raises(NotImplementedError):
        Loadable("some-id")
