"""The one step type: a (site, edit) pair and the phase it is applied in.

Capture (``tl.when``), replay (``fork.do``) and saved recipes all hold ``Step`` objects, so a
step moves between them without conversion: a recipe step replays on a fork, a fork's
steps re-run as capture-time edits (``step.for_capture()``).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .selectors import Selector, as_selector

__all__ = ["CAPTURE", "PHASES", "REPLAY", "REPLAY_MODES", "Step", "check_edit"]

CAPTURE = "capture"
REPLAY = "replay"
PHASES = (CAPTURE, REPLAY)
# How fork.do handles a changed guard: "strict" raises GuardChangedError; "fallback" re-executes
# the real forward (the trace must hold its model); "auto" falls back when it can, else raises.
REPLAY_MODES = ("auto", "strict", "fallback")


def check_edit(edit: Any) -> None:
    """Refuse what cannot be an edit (a tensor, a number, or ``fn(activation, *, ctx)``).

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(edit, (torch.Tensor, numbers.Number)) or callable(edit):
        return
    raise InvalidArgumentError(
        f"an edit must be a tensor, a number or a callable(activation, *, ctx); got {type(edit).__name__}"
    )


class Step:
    """One (site, edit) applied during capture (``phase='capture'``) or by replay (``'replay'``).

    ``fired`` lists the labels a capture-time step landed on in the capture that used it;
    ``for_capture()`` hands out a fresh copy so each capture starts with an empty list.
    """

    __slots__ = ("site", "edit", "phase", "fired")

    def __init__(self, site: Any, edit: Any, phase: str = CAPTURE) -> None:
        if phase not in PHASES:
            raise InvalidArgumentError(f"a step's phase is one of {PHASES}, got {phase!r}")
        check_edit(edit)
        self.site: Selector = as_selector(site)
        self.edit = edit
        self.phase = phase
        self.fired: list[str] = []

    def for_capture(self) -> Step:
        """A fresh capture-time copy of this step (empty ``fired``)."""
        return Step(self.site, self.edit, CAPTURE)

    def with_site(self, site: Selector) -> Step:
        """The same edit and phase at another (e.g. resolved) site."""
        return Step(site, self.edit, self.phase)

    def __repr__(self) -> str:
        name = getattr(self.edit, "name", None) or type(self.edit).__name__
        return f"Step({self.phase}, {self.site.describe()}, {name})"
