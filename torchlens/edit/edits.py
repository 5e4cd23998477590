"""What an edit is and how one is applied to an activation.

An edit is a tensor (replaces the value, broadcasting), a number (fills it), or a callable
``edit(activation, *, ctx) -> tensor``. Named helpers (``tl.zero_ablate()`` ...) are such
callables that also know how to describe themselves, so recipes can be saved without code.
"""

from __future__ import annotations

import inspect
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.steps import CAPTURE, Step, check_edit
from ..core.tree import flatten, unflatten
from ..errors import EditDtypeError, EditHadNoEffect, EditHadNoEffectError, EditShapeError, InvalidArgumentError
from ._regions import Touched


@dataclass
class EditContext:
    """Where an edit is being applied: passed to function edits as ``ctx``."""

    site: str
    label: str
    module: str | None
    pass_index: int | None
    op: Any
    trace: Any
    step: int | None = None  # the generation step being edited (``tl.generate`` and its forks); None elsewhere

    def __repr__(self) -> str:
        step = "" if self.step is None else f", step={self.step}"
        return f"EditContext(site={self.site!r}, label={self.label!r}, pass={self.pass_index}{step})"


@dataclass
class AppliedEdit:
    """One edit that landed: where, on which pass, and how many elements it changed.

    Reading the edited site (``trace[label].out``) gives the edited value, what the ops
    downstream consumed; ``before`` keeps the value the edit received (not written by
    ``trace.save``: None on a loaded trace).
    """

    site: str
    label: str
    pass_index: int | None
    n_changed: int
    how: str = "applied"  # "captured", "replayed", or "re-executed: <why>" (a fork that fell back)
    before: Any = field(default=None, repr=False, compare=False)
    # replayed edits: what replay recomputed (a torchlens.edit._regions.ReplayLog: ops, rows, fallbacks)
    replay: Any = field(default=None, repr=False, compare=False)


When = Step  # ``tl.When``: the capture-time step type (one step type for capture, replay, recipes)


def when(site: Any, edit: Any) -> Step:
    """Edit ``site`` during capture: ``tl.trace(model, x, intervene=tl.when(site, edit))``.

    Args:
        site: a selector or label; module selectors are served by hooks alone.
        edit: tensor, number, or ``fn(activation, *, ctx)``.

    Raises:
        InvalidArgumentError: ``site`` is not a selector or label, or ``edit`` is not an edit.
    """
    return Step(site, edit, CAPTURE)


def _edit_tensor(value: torch.Tensor, edit: Any, ctx: EditContext) -> torch.Tensor:
    if isinstance(edit, torch.Tensor):
        try:
            shape = torch.broadcast_shapes(edit.shape, value.shape)
        except RuntimeError:
            shape = None
        if shape != value.shape:
            raise EditShapeError(
                f"edit tensor of shape {tuple(edit.shape)} does not broadcast to the activation at "
                f"{ctx.site} of shape {tuple(value.shape)}",
                site=ctx.site,
                edit_shape=tuple(edit.shape),
                activation_shape=tuple(value.shape),
            )
        return edit.to(dtype=value.dtype, device=value.device).expand(value.shape).clone()
    if isinstance(edit, numbers.Number):
        return torch.full_like(value, edit)
    raise InvalidArgumentError(f"cannot apply edit of type {type(edit).__name__}")


def apply_edit(value: Any, edit: Any, ctx: EditContext) -> Any:
    """The edited value. Callables get the whole value (tuple outputs included); tensor and
    number edits replace the first tensor of a structured output (a block's hidden state)."""
    if callable(edit) and not isinstance(edit, torch.Tensor):
        result = call_edit(edit, value, ctx)
        if result is None:  # an in-place function edit: the value itself was changed
            return value
        if isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor):
            if result.shape != value.shape:
                try:
                    torch.broadcast_shapes(result.shape, value.shape)
                except RuntimeError:
                    raise EditShapeError(
                        f"edit at {ctx.site} returned shape {tuple(result.shape)} for an activation of "
                        f"shape {tuple(value.shape)}",
                        site=ctx.site,
                    ) from None
        _check_dtypes(value, result, ctx)
        return result
    if isinstance(value, torch.Tensor):
        return _edit_tensor(value, edit, ctx)
    leaves, spec = flatten(value)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = _edit_tensor(leaf, edit, ctx)
            return unflatten(leaves, spec)
    raise InvalidArgumentError(f"the output at {ctx.site} holds no tensor to edit")


def _check_dtypes(value: Any, result: Any, ctx: EditContext) -> None:
    """Refuse a function edit's result whose tensors change dtype (matched leaf by leaf when it keeps
    the value's structure): the ops after the site would fail inside torch (``mixed dtype``) or
    silently compute in another precision than the recorded run."""
    if isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor):
        pairs = [(value, result, "")]
    else:
        old, new = flatten(value)[0], flatten(result)[0]
        if len(old) != len(new):
            return
        pairs = [(a, b, f" (tensor {i} of the output)") for i, (a, b) in enumerate(zip(old, new))
                 if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)]
    for before, after, where in pairs:
        if after.dtype != before.dtype:
            raise EditDtypeError(
                f"edit at {ctx.site} (landed on {ctx.label}) returned dtype {after.dtype} for an activation of "
                f"dtype {before.dtype}{where}",
                site=ctx.site, label=ctx.label, expected_dtype=before.dtype, given_dtype=after.dtype,
            )


def call_edit(edit: Callable, value: Any, ctx: EditContext) -> Any:
    """Call a function edit, passing ``ctx`` only to functions that accept it."""
    return edit(value, ctx=ctx) if accepts_ctx(edit) else edit(value)


def accepts_ctx(fn: Callable) -> bool:
    """Whether a function edit takes ``ctx`` (a ``ctx`` parameter or ``**kwargs``; a callable whose
    signature cannot be read is given it). Read from the signature once, then kept on the function."""
    wants = getattr(fn, "_tl_wants_ctx", None)
    if wants is None:
        wants = _signature_takes_ctx(fn)
        try:
            fn._tl_wants_ctx = wants
        except (AttributeError, TypeError):
            pass
    return wants


def _signature_takes_ctx(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "ctx" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def count_changed(old: Any, new: Any, touched: Touched | None = None) -> int:
    """Elements that differ between two values (all of them when shapes differ).

    ``touched`` (a tensor value's rows the edit declared, :func:`~torchlens.edit._regions.edit_touches`)
    limits the comparison to those rows: the count is the same, as off them nothing changed.
    """
    if touched is not None and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) \
            and old.shape == new.shape:
        if old is new or not touched[1]:
            return 0
        index = torch.tensor(touched[1], dtype=torch.long, device=old.device)
        return int((old.index_select(touched[0], index) != new.index_select(touched[0], index)).sum())
    a_leaves, _ = flatten(old)
    b_leaves, _ = flatten(new)
    total = 0
    for a, b in zip(a_leaves, b_leaves):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                total += b.numel()
            else:
                total += int((a != b).sum().item()) if a is not b else 0
    return total


_PKG_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside TorchLens and torch (where the warning is shown)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PKG_DIR, _TORCH_DIR)):
        level, frame = level + 1, frame.f_back
    return level


def land_edit(target: Any, edit: Any, applied: AppliedEdit) -> None:
    """Record ``applied`` through ``target``; an edit that changed no element is reported first.

    ``target`` is what writes the edit down: the ``TraceBuilder`` of a capture, or a fork's
    ``changes`` (a ``ForkValues``) during replay; both say whether the trace is ``strict``.

    Every path that applies an edit (capture hooks, the recorder, replay) ends here, so all
    report alike: ``EditHadNoEffect`` is warned, or, on a strict trace
    (``tl.trace(..., strict=True)`` and its forks), ``EditHadNoEffectError`` is raised and
    nothing is recorded. Edits whose class sets ``may_change_nothing = True`` (patching a value
    that may equal the current one) are never reported.

    Raises:
        EditHadNoEffectError: the edit changed nothing and the trace is strict.
    """
    if applied.n_changed == 0 and not getattr(edit, "may_change_nothing", False):
        hint = getattr(edit, "no_effect_hint", None)
        why = hint(applied.before) if callable(hint) and applied.before is not None else ""
        message = (f"the edit {_edit_name(edit)} at {applied.site} (landed on {applied.label}, pass "
                   f"{applied.pass_index}) changed no element of the activation" + (f": {why}" if why else ""))
        if target.strict:
            raise EditHadNoEffectError(message, site=applied.site, label=applied.label)
        warnings.warn(message, EditHadNoEffect, stacklevel=_caller_stacklevel())
    target.record_edit(applied)


def _edit_name(edit: Any) -> str:
    if isinstance(edit, torch.Tensor):
        return f"tensor{tuple(edit.shape)}"
    if isinstance(edit, numbers.Number):
        return repr(edit)
    return repr(edit) if hasattr(edit, "params") else getattr(edit, "__name__", type(edit).__name__)


__all__ = [
    "AppliedEdit", "EditContext", "When", "accepts_ctx", "apply_edit", "call_edit", "check_edit", "count_changed",
    "land_edit", "when",
]
