"""The services every trace calls for work that lives above the core (installed on import).

``torchlens.core`` never imports the packages above it; this module wires them in:
binding canonical names (``arch``), replay and re-execution (``edit``), saving (``store``),
tables, facets, pictures, summaries and notebook HTML (``analysis``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .analysis.display import op_table
from .analysis.draw import draw, to_dot
from .analysis.notebook import call_html, op_html, trace_html
from .analysis.summary import summary, to_pandas
from .api import rerun
from .arch.resolve import bind
from .core.records import ModuleCall, Op
from .core.selectors import Selector
from .core.services import install
from .core.steps import Step
from .edit.replay import replay_many, replay_step
from .edit.validate import validate
from .plugins import facets_for
from .store.recipes import save_intervention
from .store.traces import save_trace

__all__ = ["Services", "install_services"]


class Services:
    """The default :class:`torchlens.core.services.TraceServices`."""

    def bind(self, model: Any, selector: Selector, *, strings_as_modules: bool) -> Selector:
        return bind(model, selector, strings_as_modules=strings_as_modules)

    def replay(self, fork: Any, step: Step, *, model: Any, inputs: Any, check: bool, replay: str) -> Any:
        if model is not None:
            step = Step(bind(model, step.site), step.edit, step.phase)
        # a re-executed strict fork stays strict, and keeps the tokenizer its inputs were made with
        strict = partial(rerun, strict=getattr(fork, "strict", False), tokenizer=fork.tokenizer)
        return replay_step(fork, step, model=model, inputs=inputs, check=check, rerun=strict, replay=replay)

    def replay_many(self, forks: list[Any], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: bool = False) -> list[Any]:
        strict = partial(rerun, strict=getattr(forks[0], "strict", False)) if forks else rerun
        return replay_many(forks, steps, rerun=strict, replay=replay, check=check, batch_size=batch_size,
                           collect_errors=collect_errors)

    def rerun(self, trace: Any, model: Any, args: tuple, kwargs: dict, steps: list[Step],
              until: Selector | None) -> Any:
        return rerun(model, args, kwargs, steps, until, strict=getattr(trace, "strict", False),
                     tokenizer=trace.tokenizer)

    def validate(self, trace: Any, **kwargs: Any) -> Any:
        return validate(trace, **kwargs)

    def save_trace(self, trace: Any, path: Any, *, selector: Any, overwrite: bool) -> Any:
        return save_trace(trace, path, selector=selector, overwrite=overwrite)

    def save_intervention(self, trace: Any, path: Any, *, level: str, overwrite: bool) -> Any:
        return save_intervention(trace, path, level=level, overwrite=overwrite)

    def table(self, trace: Any, selector: Any, limit: int | None) -> str:
        return op_table(trace, selector, limit)

    def facets(self, site: Any) -> Any:
        return facets_for(site)

    def to_dot(self, trace: Any, **options: Any) -> str:
        return to_dot(trace, **options)

    def draw(self, trace: Any, path: Any, **options: Any) -> Any:
        return draw(trace, path, **options)

    def summary(self, trace: Any) -> Any:
        return summary(trace)

    def to_pandas(self, trace: Any) -> Any:
        return to_pandas(trace)

    def html(self, obj: Any) -> str:
        if isinstance(obj, Op):
            return op_html(obj)
        if isinstance(obj, ModuleCall):
            return call_html(obj)
        return trace_html(obj)


def install_services() -> None:
    """Make :class:`Services` the services of every trace (``import torchlens`` calls this)."""
    install(Services())
