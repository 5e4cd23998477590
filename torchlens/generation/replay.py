"""Replay after the fact: a fork's steps after an edit, computed from the parent's records.

An edit at block ``L`` (of the model's stack of blocks) at step ``k`` changes nothing below
block ``L`` at any later step: the layers below read the same tokens and the same rows of their
own KV cache. So while the token each step chose is the parent's, a later step needs only
blocks ``L`` onwards, run on its one new row and reading the changed KV rows of those blocks:
blocks below ``L`` are stood in for by what the parent recorded (their KV rows copied from the
parent's cache, block ``L - 1``'s output read from the parent's step trace). The decoding code
(Hugging Face ``generate``) still chooses every token from the recomputed logits, with the RNG as
it was at that step, so an unchanged distribution redraws the same token and a changed one may not.

The token is the guard: the first step whose input token differs from the parent's runs the
whole model again, for real (captured as ``tl.generate`` captures), and so does every step after
it, continuing from the same cache (filled to that step). A step where an edit applies (the step
edited, and any step of a range) is captured for real too. A replayed step's trace is captured
on demand, the first time it is read, by running that one step again from a copy of the fork's
cache cut back to it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..api import _trace
from ..core.records import ModuleCall
from ..core.steps import Step
from ..errors import SiteError, TorchLensError, ValueNotSavedError
from ._steps import (
    StepCapture,
    cache_at,
    cache_of,
    input_length,
    positions_before,
    restore_hooks,
    set_hooks_aside,
)

if TYPE_CHECKING:
    from .trace import GenerationTrace

__all__ = ["DeferredRecord", "ReplayPlan", "ReplayingCapture", "plan_replay"]

# cache layers whose rows of a position are ``keys[:, :, position]`` and whose update appends
# the given rows after those it holds: a stood-in block copies the parent's rows into them
_ROW_LAYERS = ("DynamicLayer", "StaticLayer")


class ReplayPlan:
    """How a fork replays the steps after its edit: which blocks run, which the parent's records stand in for.

    Attributes:
        first: the step the edit reaches first.
        stack: the address of the model's stack of blocks (``"transformer.h"``); None: not found.
        layer: the first block the edit changes; blocks ``< layer`` are read from the parent.
        why: why blocks below the edit are nevertheless run ("" when they are read).
        parent: the generation forked (its tokens are the guard, its records the values read).
        hooked_edit: step ``first`` runs uncaptured too, the edit applied by a module hook.
    """

    def __init__(self, parent: GenerationTrace, first: int, stack: str | None, layer: int, why: str,
                 hooked_edit: bool = False) -> None:
        self.parent = parent
        self.first = first
        # the edit is at a module's output and the parent had no edit at step ``first``: that step runs
        # its blocks from ``layer`` with the edit applied by a module hook, and its trace is the parent's
        # step-``first`` trace with the edit replayed down it (sliced replay), made when first read
        self.hooked_edit = hooked_edit
        self.stack = stack
        self.layer = layer
        self.why = why
        self.active = True  # replaying: every token so far is the parent's
        self.diverged: int | None = None  # the first step whose input token was not the parent's

    def describe(self) -> str:
        if self.stack is None or self.layer == 0:
            return f"every block recomputed ({self.why})" if self.why else "every block recomputed"
        return (f"{self.stack}.{self.layer} onwards recomputed; {self.stack}.0..{self.layer - 1} read from "
                "the parent's records")

    def same_tokens(self, args: tuple, kwargs: dict) -> bool:
        """Whether a model call's token ids are the parent's at the positions it computes."""
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        seq = self.parent.sequences
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or seq is None:
            return False
        start = positions_before(kwargs)
        want = seq[:, start:start + ids.shape[1]]
        return want.shape == ids.shape and torch.equal(want, ids)

    @contextmanager
    def stand_in(self, model: nn.Module, step: int, kwargs: dict, start: int, length: int) -> Any:
        """Within ``with``, blocks below ``layer`` do not run: each appends the parent's KV rows of
        positions ``start .. start + length - 1`` to its cache layer and returns what block ``layer - 1``
        returned at the parent's ``step``."""
        if self.stack is None or self.layer == 0:
            yield
            return
        below = block_output(self.parent.records[step], self.stack, self.layer - 1)
        _, cache = cache_of(kwargs)
        _, parent_cache = cache_of(self.parent.records[-1].kwargs)
        blocks = model.get_submodule(self.stack)
        held = []
        for i in range(self.layer):
            block = blocks[i]
            layer = parent_cache.layers[i]
            keys = layer.keys[:, :, start:start + length]
            values = layer.values[:, :, start:start + length]

            def stood_in(*_a: Any, _i: int = i, _k: torch.Tensor = keys, _v: torch.Tensor = values,
                         **_kw: Any) -> Any:
                cache.update(_k, _v, _i)
                return below

            held.append((block, block.__dict__.get("forward", _NONE)))
            block.__dict__["forward"] = stood_in
        try:
            yield
        finally:
            for block, previous in held:
                if previous is _NONE:
                    block.__dict__.pop("forward", None)
                else:
                    block.__dict__["forward"] = previous


_NONE = object()


def plan_replay(gen: GenerationTrace, inner: Any, first: int) -> tuple[ReplayPlan | None, str]:
    """The replay of ``gen``'s steps after an edit at ``inner`` (a bound site) reaching step ``first``
    first; ``(None, why)`` when the fork must re-execute instead."""
    run = gen.run
    if run.loop is not None:
        return None, "a decoding loop runs from its inputs, not from a cache"
    if gen.sequences is None:
        return None, "the parent's decoding returned no token ids to guard against"
    last_key, parent_cache = cache_of(gen.records[-1].kwargs)
    if parent_cache is None or not callable(getattr(parent_cache, "update", None)):
        return None, "the generation ran without a KV cache (each step recomputes every position)"
    stack, layer, why = _edited_layer(gen, inner, first)
    if stack is not None and layer > 0:
        why = _stand_in_refused(gen, parent_cache, stack, layer, first)
        if why:
            layer = 0
    hooked = _module_site(gen.records[first].trace, inner) and not any(when.contains(first) for _, when, _ in gen.edits)
    return ReplayPlan(gen, first, stack, layer, why, hooked), ""


def _module_site(trace: Any, inner: Any) -> bool:
    """Whether ``inner`` names module outputs only (module hooks can apply an edit there)."""
    try:
        return trace.bind(inner, strings_as_modules=True).module_paths() is not None
    except SiteError:
        return False


def _edited_layer(gen: GenerationTrace, inner: Any, first: int) -> tuple[str | None, int, str]:
    """``(stack, L, why)``: the model's stack of blocks and the first block of it the edit at ``inner``
    changes (0 with the reason when it is not inside a block)."""
    trace = gen.records[first].trace
    try:
        found = trace.find_sites(trace.bind(inner, strings_as_modules=True))
    except SiteError:
        return None, 0, "the edited site is not in the parent's step"
    addresses = [site.record.address if isinstance(site.record, ModuleCall) else site.record.module
                 for site in found]
    stack, layers = None, []
    for address in addresses:
        found_stack = _stack_of(gen.model, address)
        if found_stack is None or (stack is not None and found_stack[0] != stack):
            return None, 0, f"the edit at {address or 'the model itself'} is not inside one stack of blocks"
        stack = found_stack[0]
        layers.append(found_stack[1])
    if stack is None:
        return None, 0, "the edit names no module"
    return stack, min(layers), ""


def _stack_of(model: nn.Module, address: str | None) -> tuple[str, int] | None:
    """``(stack, i)`` when ``address`` is block ``i`` of a ``ModuleList`` of the model, or inside it."""
    if not address:
        return None
    parts = address.split(".")
    for m in range(1, len(parts)):
        if not parts[m].isdigit():
            continue
        try:
            container = model.get_submodule(".".join(parts[:m]))
        except AttributeError:
            return None
        if isinstance(container, nn.ModuleList) and len(container) > 1:
            return ".".join(parts[:m]), int(parts[m])
    return None


def _stand_in_refused(gen: GenerationTrace, cache: Any, stack: str, layer: int, first: int) -> str:
    """Why blocks below ``layer`` cannot be read from ``gen``'s records ("" when they can)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or len(layers) < layer:
        return f"a {type(cache).__name__} does not hold its rows layer by layer"
    kinds = {type(layers[i]).__name__ for i in range(layer)}
    if not kinds <= set(_ROW_LAYERS):
        return f"cache layers of type {sorted(kinds - set(_ROW_LAYERS))} cannot be filled from the parent's rows"
    for k in range(first, len(gen.records)):
        try:
            block_output(gen.records[k], stack, layer - 1)
        except (SiteError, ValueNotSavedError):
            return f"the parent did not keep the output of {stack}.{layer - 1} (save=) at step {k}"
    return ""


def block_output(record: Any, stack: str, i: int) -> Any:
    """What block ``i`` of ``stack`` returned at a step: read from the record it was stood in from
    when the step did not run it (a fork's step), so no trace is made to read it."""
    while isinstance(record, DeferredRecord) and record.source is not None and i < record.stood_in:
        record = record.source
    trace = record.trace
    return trace.module_output(trace.module_call(f"{stack}.{i}"))


class DeferredRecord:
    """A step a fork ran without capturing it: its positions, RNG state and output, and a trace
    made the first time it is asked for: ``replay_from`` (a trace and an edit) by pushing the edit
    down that trace (sliced replay), otherwise (or if that cannot reproduce it) by running that one
    step again, with its edits ``steps``, from a copy of the fork's cache cut back to it.
    ``kind`` is the fork record's word for the step: "replayed" (computed from the parent's records),
    "edited" (the edited step, run from the edited block) or "regenerated" (the whole model ran)."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, start: int, length: int | None,
                 rng_state: torch.Tensor, output: Any, keep: Any, backend: str | None, kind: str,
                 steps: list[Step] | None = None, replay_from: Any = None, source: Any = None,
                 stood_in: int = 0) -> None:
        self.kind = kind
        self.source = source  # the parent's record of this step, whose blocks below ``stood_in`` it read
        self.stood_in = stood_in
        self.replayed = kind == "replayed"
        self.model = model
        self.args = args
        self._kwargs = kwargs
        self.start = start
        self.length = length
        self.rng_state = rng_state
        self.output = output
        self._keep = keep
        self._backend = backend
        self._steps = steps
        self._replay_from = replay_from
        self._trace: Any = None

    @property
    def kwargs(self) -> dict:
        return self._kwargs

    @property
    def materialized(self) -> bool:
        return self._trace is not None

    @property
    def trace(self) -> Any:
        """The step's trace, made the first time it is asked for."""
        if self._trace is None and self._replay_from is not None:
            trace, step = self._replay_from
            try:
                self._trace = trace.fork().do(step.site, step.edit, replay="strict")
            except TorchLensError:  # a guard or an unkept value: run the step again instead
                self._replay_from = None
        if self._trace is None:
            kwargs = dict(self._kwargs)
            key, cache = cache_of(kwargs)
            kwargs[key] = cache_at(cache, self.start)
            held = set_hooks_aside(self.model)
            try:
                with torch.no_grad():
                    self._trace = _trace(self.model, self.args, kwargs, save=self._keep, intervene=self._steps or None,
                                         backend=self._backend)
            finally:
                restore_hooks(self.model, held)
        return self._trace


class ReplayingCapture(StepCapture):
    """:class:`StepCapture` that replays the steps after ``plan.first`` while their tokens are the parent's.

    Steps where an edit applies are captured for real; the others run uncaptured (their traces
    are captured on demand): the blocks from ``plan.layer`` with the rest stood in for while every
    token is the parent's, the whole model from the first step whose token differs.
    """

    def __init__(self, model: nn.Module, edits: list, save: Any, backend: str | None, on_step: Any,
                 first: int = 0, *, plan: ReplayPlan) -> None:
        super().__init__(model, edits, save, backend, on_step, first=first)
        self.plan = plan
        self.kinds: dict[int, str] = {}  # step -> "edited" | "replayed" | "regenerated"

    def _step(self, args: tuple, kwargs: dict) -> Any:
        k, plan = self.count, self.plan
        if plan.active and k > plan.first and not plan.same_tokens(args, kwargs):
            plan.active, plan.diverged = False, k
        start, length = positions_before(kwargs), input_length(args, kwargs)
        steps = self.step_edits(k, start, length)
        self.kinds[k] = "edited" if plan.active and steps else "regenerated" if not plan.active else "replayed"
        if steps and k == plan.first and plan.hooked_edit:
            return self._hooked_edit(k, args, kwargs, start, length, steps)
        if steps:
            return self.capture(k, args, kwargs, start, length, steps)
        return self._uncaptured(k, args, kwargs, start, length, plan.active)

    def _hooked_edit(self, k: int, args: tuple, kwargs: dict, start: int, length: int | None,
                     steps: list[Step]) -> Any:
        """The edited step, its blocks from ``plan.layer`` run with the edit applied by module hooks
        (the rest stood in for); its trace is the parent's with the edit replayed down it, when read."""
        rng = torch.get_rng_state()
        with self.plan.stand_in(self.model, k, kwargs, start, length or 0):
            trace = self.capture_trace(k, args, kwargs, start, length, steps, [s.site for s in steps], "hooks")
        self.count += 1
        self.on_step(DeferredRecord(self.model, args, kwargs, start, length, rng, trace.raw_output, self.keep_at(k),
                                    self.backend, "edited", steps, (self.plan.parent.records[k].trace, steps[0]),
                                    *self._stood_in(k)))
        return trace.raw_output

    def _uncaptured(self, k: int, args: tuple, kwargs: dict, start: int, length: int | None, replay: bool) -> Any:
        """Step ``k`` run without a capture (``replay``: blocks below the edit stood in for)."""
        rng = torch.get_rng_state()
        if replay:
            with self.plan.stand_in(self.model, k, kwargs, start, length or 0):
                output = self._forward(*args, **kwargs)
        else:
            output = self._forward(*args, **kwargs)
        self.count += 1
        self.on_step(DeferredRecord(self.model, args, kwargs, start, length, rng, output, self.keep_at(k),
                                    self.backend, "replayed" if replay else "regenerated", None, None,
                                    *(self._stood_in(k) if replay else (None, 0))))
        return output

    def _stood_in(self, k: int) -> tuple[Any, int]:
        """The parent's record of step ``k`` and how many blocks this step read from it."""
        plan = self.plan
        return (plan.parent.records[k], plan.layer) if plan.stack is not None and plan.layer > 0 else (None, 0)
