"""Sites that address generation steps: ``tl.at_step(site, steps)``.

A step is one call of the model's forward during generation (step 0 reads the prompt). A plain
site given to ``tl.generate`` or a generation trace means *every* step, as a forward hook fires on
every call; ``tl.at_step(site, k)`` narrows it to step ``k``, ``tl.at_step(site, range(2, 6))`` to a
range (``range(2, None)`` or ``slice(2, None)``: step 2 onwards), ``tl.at_step(site, [0, 4])`` to a list.
"""

from __future__ import annotations

import numbers
from typing import Any

from ..core.records import ModuleCall, Op
from ..core.selectors import Record, Selector, as_selector
from ..core.steps import check_edit
from ..errors import InvalidArgumentError, SiteNotInStepError, StepNotFoundError, StepSiteOutsideGenerationError

__all__ = ["AtStep", "NoSite", "StepKeep", "StepSet", "at_step", "check_outside_encoder", "check_reached",
           "edit_triple", "split_step"]


class StepSet:
    """Which steps a site addresses: every step, one, a list, or a (possibly open-ended) range."""

    __slots__ = ("start", "stop", "stride", "items")

    def __init__(self, steps: Any = None) -> None:
        self.items: tuple[int, ...] | None = None
        self.start, self.stop, self.stride = 0, None, 1
        if steps is None:
            return
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            self.items = (int(steps),)
        elif isinstance(steps, (range, slice)):
            if steps.step is not None and steps.step <= 0:
                raise InvalidArgumentError(f"a step range counts upwards; got step {steps.step}")
            if (steps.start or 0) < 0 or (steps.stop is not None and steps.stop < 0):
                raise InvalidArgumentError(f"a step range takes step indices from 0; got {steps!r}",
                                           remedy="Count steps from 0 (step 0 reads the prompt).")
            self.start, self.stop, self.stride = steps.start or 0, steps.stop, steps.step or 1
        elif isinstance(steps, (list, tuple)) and steps and all(
                isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in steps):
            self.items = tuple(int(s) for s in steps)
        else:
            raise InvalidArgumentError(
                f"steps are an int, a range, a slice or a list of ints; got {type(steps).__name__} {steps!r:.40}",
                remedy="tl.at_step(site, 3), tl.at_step(site, range(2, 6)), tl.at_step(site, slice(2, None)).")

    @property
    def every(self) -> bool:
        return self.items is None and self.start == 0 and self.stop is None and self.stride == 1

    @property
    def single(self) -> bool:
        """One step named by an int: a read gives its value, not a dict."""
        return self.items is not None and len(self.items) == 1

    def contains(self, k: int) -> bool:
        """Whether step ``k`` (counted from 0, as it runs) is one of these steps."""
        if self.items is not None:
            return k in self.items
        return k >= self.start and (self.stop is None or k < self.stop) and (k - self.start) % self.stride == 0

    def highest(self) -> int | None:
        """The highest step named explicitly (None: open-ended or every step)."""
        if self.items is not None:
            return max(self.items)
        if self.stop is None:
            return self.start if self.start else None
        last = self.start + ((self.stop - 1 - self.start) // self.stride) * self.stride
        return last if last >= self.start else None

    def negative(self) -> bool:
        return self.items is not None and any(k < 0 for k in self.items)

    def resolve(self, n: int) -> list[int]:
        """The step indices among ``n`` steps (negative ints count from the end).

        Raises:
            StepNotFoundError: a step named explicitly is not among the ``n`` steps.
        """
        if self.items is not None:
            out = []
            for k in self.items:
                if not -n <= k < n:
                    raise StepNotFoundError(
                        f"step {k} is beyond the generation's {n} step(s) (0..{n - 1}: step 0 reads the prompt, "
                        f"step k > 0 the token chosen at step k-1)", step=k, n_steps=n)
                out.append(k % n)
            return out
        highest = self.highest()
        if self.stop is not None and highest is not None and highest >= n:
            raise StepNotFoundError(f"steps up to {highest} are beyond the generation's {n} step(s) (0..{n - 1})",
                                    step=highest, n_steps=n)
        return [k for k in range(self.start, n if self.stop is None else min(n, self.stop), self.stride)]

    def describe(self) -> str:
        if self.items is not None:
            return str(self.items[0]) if self.single else repr(list(self.items))
        if self.every:
            return "every step"
        stop = "" if self.stop is None else self.stop
        return f"{self.start}:{stop}" + (f":{self.stride}" if self.stride != 1 else "")


class AtStep(Selector):
    """A site at some steps of a generation (``tl.at_step``); the inner site is any selector."""

    def __init__(self, site: Any, steps: Any) -> None:
        if isinstance(site, AtStep):
            raise InvalidArgumentError("tl.at_step() takes a site without steps; give the steps once")
        self.site: Selector = as_selector(site)
        self.steps = StepSet(steps)

    def _outside(self) -> StepSiteOutsideGenerationError:
        return StepSiteOutsideGenerationError(
            f"{self.describe()} addresses steps of a generation, but was given to a single forward's trace")

    def match(self, trace: Any) -> list[Record]:
        raise self._outside()

    def matches_op(self, op: Op) -> bool:
        raise self._outside()

    def matches_call(self, call: ModuleCall) -> bool:
        raise self._outside()

    def describe(self) -> str:
        return f"at_step({self.site.describe()}, {self.steps.describe()})"

    __repr__ = describe


def at_step(site: Any, steps: Any) -> AtStep:
    """``site`` at some steps of a generation: ``steps`` is an int, a range, a slice or a list of ints.

    Step ``k`` is the ``k``-th call of the model's forward during ``tl.generate`` (step 0 reads the
    prompt; with a KV cache, step ``k > 0`` reads the one token chosen at step ``k - 1``). A site
    without ``at_step`` means every step.

    Raises:
        InvalidArgumentError: ``steps`` is not an int, range, slice or list of ints, or counts down.
    """
    return AtStep(site, steps)


def split_step(site: Any) -> tuple[Selector, StepSet]:
    """``(inner selector, steps)`` of a site given to generation (a plain site: every step)."""
    if isinstance(site, AtStep):
        return site.site, site.steps
    return as_selector(site), StepSet(None)


def edit_triple(site: Any, edit: Any) -> tuple[Selector, StepSet, Any]:
    """``(inner site, steps, edit)`` of one edit during generation.

    Raises:
        InvalidArgumentError: not an edit, or steps counted from the end (unknown before generating).
    """
    check_edit(edit)
    inner, steps = split_step(site)
    if steps.negative():
        raise InvalidArgumentError(f"{site!r}: an edit's steps count from 0 (the number of steps is not known "
                                   "before generating)", remedy="Give steps from 0: tl.at_step(site, 5).")
    return inner, steps, edit


def check_reached(edits: list[tuple[Selector, StepSet, Any]], n: int, before: bool = False) -> None:
    for inner, steps, _ in edits:
        highest = steps.highest()
        if highest is not None and highest >= n:
            ran = f"can run at most {n} step(s)" if before else f"ran {n} step(s)"
            raise StepNotFoundError(
                f"the edit at {inner.describe()} names step {highest}, but this generation {ran} (0..{n - 1}); "
                f"step 0 reads the prompt", step=highest, n_steps=n,
                remedy="Name steps below the number of steps (max_new_tokens steps with a KV cache), "
                       "or an open range: tl.at_step(site, slice(k, None)).")


class NoSite(Selector):
    """Matches nothing: ``save=`` of a step that no ``tl.at_step`` save site names (its trace keeps no value)."""

    def match(self, trace: Any) -> list[Record]:
        return []

    def describe(self) -> str:
        return "no site"


class StepKeep:
    """``save=`` of a generation, step by step: plain sites at every step, ``tl.at_step`` sites at theirs.

    Raises:
        InvalidArgumentError: an ``at_step`` site of ``save=`` counts its steps from the end.
    """

    def __init__(self, save: Any) -> None:
        self.save = save
        self.entries: list[tuple[Selector, StepSet]] | None = None  # None: the same save= at every step
        items = save if isinstance(save, (list, tuple)) else [save]
        if save is None or not any(isinstance(item, AtStep) for item in items):
            return
        self.entries = []
        for item in items:
            inner, steps = split_step(item)
            if steps.negative():
                raise InvalidArgumentError(f"save={item!r}: steps count from 0 (the number of steps is not known "
                                           "before generating)", remedy="Give steps from 0: tl.at_step(site, 5).")
            self.entries.append((inner, steps))

    def at(self, k: int) -> Any:
        """What step ``k``'s capture keeps."""
        if self.entries is None:
            return self.save
        chosen = [inner for inner, steps in self.entries if steps.contains(k)]
        return chosen or NoSite()

    def triples(self) -> list[tuple[Selector, StepSet, Any]]:
        """``(site, steps, None)`` per step-bound entry: what ``check_reached`` checks."""
        return [(inner, steps, None) for inner, steps in self.entries or () if not steps.every]


def check_outside_encoder(model: Any, sites: list[Any]) -> None:
    """Refuse a site inside an encoder-decoder model's encoder: ``generate`` runs the encoder once, itself,
    before step 0, outside the model calls that are the steps, so no step has it to read or edit.

    Raises:
        SiteNotInStepError: a site names a module of the encoder (or the encoder itself).
    """
    encoder = _encoder_address(model)
    if encoder is None:
        return
    for site in sites:
        inner, _ = split_step(site)
        path = next((getattr(inner, a) for a in ("path", "label") if isinstance(getattr(inner, a, None), str)), None)
        address = None if path is None else path.split(":")[0]
        if address is not None and (address == encoder or address.startswith(encoder + ".")):
            inside = address[len(encoder) + 1:] or "the encoder's output"
            raise SiteNotInStepError(
                f"{inner.describe()} is in the encoder of {type(model).__name__}, which generate runs once, before "
                f"step 0 and outside the model calls that are the steps (each step reads encoder_outputs)",
                site=inner.describe(),
                remedy=f"Run the encoder yourself and generate from its output: enc = tl.trace(model.{encoder}, ids, "
                       f"intervene=tl.when({inside!r}, edit)).raw_output (or save= to read it), then "
                       f"tl.generate(model, {{'input_ids': ids, 'encoder_outputs': enc}}, ...).")


def _encoder_address(model: Any) -> str | None:
    """The address of an encoder-decoder model's encoder (None: not an encoder-decoder, or no ``get_encoder``)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    get = getattr(model, "get_encoder", None)
    encoder = get() if callable(get) else None
    return next((name for name, module in model.named_modules() if module is encoder and name), None)
