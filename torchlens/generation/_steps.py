"""One capture per call of the model's forward while a generation runs.

:class:`StepCapture` puts a wrapper in the model's instance ``forward`` slot for the duration of
``with``: each call of the model from the decoding code (Hugging Face ``generate``, or a user's
loop) becomes one ``tl.trace`` capture — a step — with that step's capture-time edits, and returns
what the model returned (edits included) to the decoding code. The capture calls the model again;
that inner call finds the wrapper re-entered and runs the model's own forward. ``__exit__`` gives
the slot back what it held (nothing, or the forward accelerate or the user put there), also when
the generation raises or is interrupted.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import _trace
from ..core.inputs import split_inputs
from ..core.steps import Step
from ..edit.edits import EditContext, accepts_ctx
from ..errors import (
    EditNotAppliedError,
    EditShapeError,
    EmptyGenerationError,
    SiteNotInStepError,
    StepEditShapeError,
)
from .sites import StepKeep, StepSet

__all__ = ["GenerationRun", "StepCapture", "StepRecord", "cache_at", "cache_of", "for_step", "input_length",
           "positions_before", "record_steps", "restore_hooks", "run_generate", "set_hooks_aside"]

_NO_FORWARD = object()
# the model's own hook dictionaries: while a step's capture calls the model again, they are set
# aside (the decoding code's call already ran them, and runs the post hooks once the step returns)
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass
class StepRecord:
    """What one step left: its trace, the positions it computed, and the RNG state it started with."""

    trace: Any
    start: int | None  # first absolute position of the step's input (None: unknown)
    length: int | None  # number of positions it computed
    rng_state: torch.Tensor | None = field(default=None, repr=False)

    @property
    def kwargs(self) -> dict:
        """The keyword arguments of the step's model call (its KV cache among them)."""
        return self.trace.kwargs

    @property
    def output(self) -> Any:
        """What the model call returned to the decoding code (edits included)."""
        return self.trace.raw_output


@dataclass
class GenerationRun:
    """How a generation was made, so a fork can make it again: inputs, decoding, capture settings."""

    inputs: Any
    loop: Callable[..., Any] | None
    kwargs: dict
    keep: Any  # the save= sites (a field named save would take nnsight's object.save as its default)
    backend: str | None
    tokenizer: Any
    start_rng: torch.Tensor = field(repr=False)


def cache_of(kwargs: dict) -> tuple[str | None, Any]:
    """The keyword and object of the KV cache a model call receives ((None, None): none)."""
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            return key, kwargs[key]
    return None, None


def input_length(args: tuple, kwargs: dict) -> int | None:
    """How many positions a model call computes: the sequence length of its token ids or embeddings."""
    for key in ("input_ids", "inputs_embeds", "decoder_input_ids"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[1])
    return None


def positions_before(kwargs: dict) -> int:
    """Positions the KV cache a model call receives already holds (0: no cache, an empty one)."""
    _, cache = cache_of(kwargs)
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length())
    if isinstance(cache, (tuple, list)) and cache:  # the legacy layout: per layer (keys, values)
        first = cache[0][0] if isinstance(cache[0], (tuple, list)) else cache[0]
        if isinstance(first, torch.Tensor) and first.dim() >= 2:
            return int(first.shape[-2])
    return 0


def for_step(edit: Any, k: int, start: int | None = None, length: int | None = None) -> Any:
    """``edit`` as step ``k`` (computing positions ``start .. start + length - 1``) applies it; None
    when it does not apply there.

    An edit reading another generation (``tl.patch_from(gen)``) reads that generation's step ``k``.
    An edit at token positions (``tl.add(v, positions=[p])``) takes absolute positions: it applies at
    the steps that compute ``p``, at ``p``'s row there (a negative position counts from each step's
    last row). Any other edit is itself.
    """
    pick = getattr(getattr(edit, "source", None), "step_trace", None)
    if callable(pick):
        edit = copy.copy(edit)
        edit.source = pick(k)
    positions = getattr(edit, "positions", None)
    if isinstance(positions, list) and start is not None and length is not None:
        rows = [p if p < 0 else p - start for p in positions if p < 0 or start <= p < start + length]
        if not rows:
            return None
        if rows != positions:
            edit = copy.copy(edit)
            edit.positions = rows
    if isinstance(edit, (types.FunctionType, types.MethodType, functools.partial)) and accepts_ctx(edit):
        edit = _StepFunction(edit, k)
    return edit


class _StepFunction:
    """A function edit ``(activation, *, ctx)`` as step ``k`` calls it: ``ctx.step`` is ``k``. (Only
    plain functions: a helper object keeps its type, whose declared rows replay reads.)"""

    __slots__ = ("fn", "step", "_tl_wants_ctx")

    def __init__(self, fn: Callable[..., Any], step: int) -> None:
        self.fn = fn
        self.step = step
        self._tl_wants_ctx = True

    def __call__(self, value: Any, *, ctx: EditContext) -> Any:
        return self.fn(value, ctx=dataclasses.replace(ctx, step=self.step))

    def __repr__(self) -> str:
        return f"{self.fn!r} at step {self.step}"


class StepCapture:
    """Within ``with``, each call of ``model`` from this thread is captured as one step.

    Args:
        model: the model whose calls are steps.
        edits: ``(inner selector, steps, edit)`` triples; a step gets the edits whose steps contain it.
        save: ``save=`` of every step's capture (None: every value).
        backend: the capture engine of every step (None: the cheapest that serves it).
        on_step: called with each finished :class:`StepRecord`.
        first: the index of the first step captured (a fork resuming at step ``k`` counts from ``k``).
    """

    def __init__(self, model: nn.Module, edits: list[tuple[Any, StepSet, Any]], save: Any, backend: str | None,
                 on_step: Callable[[StepRecord], None], first: int = 0) -> None:
        self.model = model
        self.edits = edits
        self.save = save
        self.backend = backend
        self.on_step = on_step
        self.count = first
        self._keep = StepKeep(save)
        self._owner: int | None = None
        self._inside = False
        self._previous: Any = _NO_FORWARD
        self._forward: Any = None

    def __enter__(self) -> StepCapture:
        own = self.model.__dict__
        self._previous = own.get("forward", _NO_FORWARD)
        self._forward = self.model.forward  # the bound forward, or what the slot holds (accelerate's)
        self._owner = threading.get_ident()
        own["forward"] = self._wrapper()
        return self

    def __exit__(self, *exc: Any) -> None:
        own = self.model.__dict__
        if self._previous is _NO_FORWARD:
            own.pop("forward", None)
        else:
            own["forward"] = self._previous

    def _wrapper(self) -> Callable[..., Any]:
        # the forward's own signature shows through (``__wrapped__``): generate reads it to decide which
        # inputs to pass (position_ids, logits_to_keep ...), and must pass what it passes to the model
        @functools.wraps(self._forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._inside or threading.get_ident() != self._owner:
                return self._forward(*args, **kwargs)  # the capture's own call, or another thread's
            self._inside = True
            try:
                return self._step(args, kwargs)
            finally:
                self._inside = False

        return forward

    def step_edits(self, k: int, start: int, length: int | None) -> list[Step]:
        """The capture-time edits of step ``k`` (computing ``length`` positions from ``start``)."""
        steps = []
        for site, when, edit in self.edits:
            if when.contains(k):
                edit = for_step(edit, k, start, length)
                if edit is not None:
                    steps.append(Step(site, edit))
        return steps

    def keep_at(self, k: int) -> Any:
        """``save=`` of step ``k``'s capture: the sites kept at every step and those ``tl.at_step`` names at ``k``."""
        return self._keep.at(k)

    def _step(self, args: tuple, kwargs: dict) -> Any:
        k = self.count
        start, length = positions_before(kwargs), input_length(args, kwargs)
        return self.capture(k, args, kwargs, start, length, self.step_edits(k, start, length))

    def capture(self, k: int, args: tuple, kwargs: dict, start: int, length: int | None, steps: list[Step]) -> Any:
        """Capture step ``k`` with ``steps`` as its edits; what the model returned."""
        rng = torch.get_rng_state()
        trace = self.capture_trace(k, args, kwargs, start, length, steps, self.keep_at(k), self.backend)
        self.count += 1
        self.on_step(StepRecord(trace, start, length, rng))
        return trace.raw_output

    def capture_trace(self, k: int, args: tuple, kwargs: dict, start: int, length: int | None, steps: list[Step],
                      save: Any, backend: str | None) -> Any:
        """The trace of step ``k``'s model call with ``steps`` as its edits (errors named with the step)."""
        hooks = self._set_hooks_aside()
        try:
            return _trace(self.model, args, kwargs, save=save, intervene=steps or None, backend=backend)
        except (StepEditShapeError, SiteNotInStepError):
            raise
        except EditNotAppliedError as err:
            raise SiteNotInStepError(f"at step {k}: {err.message}", step=k, **err.fields) from err
        except EditShapeError as err:
            where = "" if length is None else f" ({length} position(s) from {start})"
            raise StepEditShapeError(f"at step {k}{where}: {err.message}", step=k, positions=length,
                                     **err.fields) from err
        finally:
            self._restore_hooks(hooks)

    def _set_hooks_aside(self) -> dict[str, Any]:
        return set_hooks_aside(self.model)

    def _restore_hooks(self, held: dict[str, Any]) -> None:
        restore_hooks(self.model, held)


def set_hooks_aside(model: nn.Module) -> dict[str, Any]:
    """Empty the model's own hook dictionaries for a capture's call (they ran on the outer call)."""
    held = {}
    for name in _HOOK_DICTS:
        hooks = getattr(model, name, None)
        if hooks:
            held[name] = hooks
            setattr(model, name, OrderedDict())
    return held


def restore_hooks(model: nn.Module, held: dict[str, Any]) -> None:
    for name, hooks in held.items():
        setattr(model, name, hooks)


def cache_at(cache: Any, start: int) -> Any:
    """A copy of KV cache ``cache`` holding its first ``start`` positions only (what a step
    computing from ``start`` received); the original is left as it is."""
    cache = copy.deepcopy(cache)
    extra = cache.get_seq_length() - start
    if extra > 0:
        cache.crop(-extra)
    return cache


def record_steps(model: nn.Module, run: GenerationRun, edits: list[tuple[Any, StepSet, Any]], *,
                 inputs: Any = None, kwargs: dict | None = None, first: int = 0,
                 capture: type[StepCapture] | Callable[..., StepCapture] | None = None
                 ) -> tuple[list[StepRecord], Any]:
    """Run ``run``'s decoding (on other ``inputs`` / ``kwargs`` when given: a fork resuming at step
    ``first``) with one capture per model call; the step records and what the decoding returned.
    ``capture`` builds the per-call capture (default :class:`StepCapture`; a fork's replay passes its own).

    Raises:
        EmptyGenerationError: the decoding never called the model.
    """
    inputs = run.inputs if inputs is None else inputs
    records: list[StepRecord] = []
    with (capture or StepCapture)(model, edits, run.keep, run.backend, records.append, first=first):
        if run.loop is not None:
            output = run.loop(model, inputs)
        else:
            output = run_generate(model, inputs, run.kwargs if kwargs is None else kwargs)
    if not records:
        raise EmptyGenerationError("the decoding loop never called the model, so there is no step to record")
    return records, output


def run_generate(model: nn.Module, inputs: Any, kwargs: dict) -> Any:
    args, kw = split_inputs(inputs)
    return model.generate(*args, **kw, **kwargs, disable_compile=True)
