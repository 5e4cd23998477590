"""Trace's and Site's methods that live above the core, provided by their owning packages on import."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from torchlens.analysis.draw import to_dot
from torchlens.analysis.summary import summary
from torchlens.core.actions import provide_methods, provided_methods
from torchlens.core.sites import Site
from torchlens.core.trace import Trace
from torchlens.errors import TorchLensError

OWNERS = {
    (Trace, "validate"): "torchlens.edit.validate.ValidateMethod",
    (Trace, "save"): "torchlens.store.traces.SaveMethod",
    (Trace, "save_intervention"): "torchlens.store.recipes.SaveInterventionMethod",
    (Trace, "table"): "torchlens.analysis.display.TableMethod",
    (Trace, "to_dot"): "torchlens.analysis.draw.DrawMethods",
    (Trace, "draw"): "torchlens.analysis.draw.DrawMethods",
    (Trace, "summary"): "torchlens.analysis.summary.SummaryMethods",
    (Trace, "to_pandas"): "torchlens.analysis.summary.SummaryMethods",
    (Site, "facets"): "torchlens.analysis.facets.FacetsProperty",
}


def test_import_torchlens_provides_every_method_from_its_owner():
    assert {k: v for k, v in provided_methods().items() if k[0] in (Trace, Site)} == OWNERS


def test_provided_methods_work_on_traces_and_forks():
    """A fork inherits the provided methods; each gives what the owning package's function gives."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    trace = tl.trace(model, torch.randn(2, 4))
    fork = trace.fork().do("0", tl.zero_ablate())
    assert fork.to_dot(depth=None) == to_dot(fork, depth=None) != trace.to_dot(depth=None)
    assert str(fork.summary()) == str(summary(fork))
    assert trace.validate().ok and "relu" in trace.table()


class _Target:
    def taken(self) -> int:
        return 1


def test_a_method_has_one_owner():
    """Providing a name the class defines, or one another mixin provided, is refused; the class keeps its own."""
    with pytest.raises(TorchLensError) as err:
        @provide_methods(_Target)
        class Clash:
            def taken(self) -> int:
                return 2
    assert "taken" in str(err.value) and err.value.remedy
    assert _Target().taken() == 1

    @provide_methods(_Target)
    class First:
        def extra(self) -> str:
            return "first"

    with pytest.raises(TorchLensError, match="First"):
        @provide_methods(_Target)
        class Second:
            def extra(self) -> str:
                return "second"
    assert _Target().extra() == "first"
