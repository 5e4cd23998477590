"""The core's services (``torchlens.core.services.TraceServices``), installed on import.

``torchlens.core`` never imports the packages above it; this module wires in the few things it
must ask for: a model's names (``arch``), replay (``edit``) and re-execution (``api.rerun``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from .api import rerun
from .arch.resolve import ModelNames, bind
from .core.fork import Fork
from .core.selectors import Selector
from .core.services import install
from .core.steps import Step
from .core.trace import Trace
from .edit.replay import replay_many, replay_step

__all__ = ["Services", "install_services"]


class Services:
    """The default :class:`torchlens.core.services.TraceServices`."""

    def names(self, model: nn.Module) -> ModelNames:
        return ModelNames(model)

    def replay(self, fork: Fork, step: Step, *, model: nn.Module | None, inputs: Any, check: bool,
               replay: str) -> Fork:
        if model is not None:
            step = Step(bind(model, step.site), step.edit, step.phase)
        # a re-executed strict fork stays strict, and keeps the tokenizer its inputs were made with
        strict = partial(rerun, strict=getattr(fork, "strict", False), tokenizer=fork.tokenizer)
        return replay_step(fork, step, model=model, inputs=inputs, check=check, rerun=strict, replay=replay)

    def replay_many(self, forks: list[Fork], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: bool = False) -> list[Fork] | list[BaseException | None]:
        strict = partial(rerun, strict=getattr(forks[0], "strict", False)) if forks else rerun
        return replay_many(forks, steps, rerun=strict, replay=replay, check=check, batch_size=batch_size,
                           collect_errors=collect_errors)

    def rerun(self, trace: Trace, model: nn.Module, args: tuple, kwargs: dict[str, Any], steps: list[Step],
              until: Selector | None) -> Trace:
        return rerun(model, args, kwargs, steps, until, strict=getattr(trace, "strict", False),
                     tokenizer=trace.tokenizer)


def install_services() -> None:
    """Make :class:`Services` the services of every trace (``import torchlens`` calls this)."""
    install(Services())
