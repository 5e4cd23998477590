"""``GenerationTrace``: the steps of one generation, each a trace of one forward.

Positions are absolute token indices into ``gen.sequences`` (the prompt starts at 0), so
"position 17" names the same token at every step. With a KV cache, step 0 computes the
prompt's positions ``0 .. prompt_length-1`` and step ``k > 0`` computes the one position
``prompt_length + k - 1`` (the token chosen at step ``k - 1``); without a cache, every step
computes every position so far. ``step.positions`` says which, for any decoding code.
"""

from __future__ import annotations

from collections.abc import Iterator
from html import escape
from typing import Any

import torch

from ..core.sites import Site
from ..core.trace import Trace
from ..core.tree import first_tensor
from ..errors import (
    InvalidArgumentError,
    PositionNotInStepError,
    SiteError,
    SiteNotFoundError,
    SiteNotInStepError,
    StepNotFoundError,
    ValueNotSavedError,
)
from ._steps import GenerationRun, StepRecord
from .compare import GenerationComparison, compare_generations
from .fork import ForkRecord, rerun
from .sites import StepSet, check_outside_encoder, edit_triple, split_step

__all__ = ["GenerationFork", "GenerationStep", "GenerationTrace", "StepList"]


def _logits_of(output: Any) -> torch.Tensor | None:
    """The logits a model call returned: ``output.logits``, the output itself, or its first tensor."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class GenerationStep:
    """Step ``index`` of a generation: one forward's trace, the positions it computed, its token.

    ``step["transformer.h.0"]`` is a site of the step's trace (``step.trace``, a ``tl.Trace``:
    ``step.ops``, ``step.modules``, forks, facets ...).
    """

    def __init__(self, gen: GenerationTrace, index: int, record: StepRecord) -> None:
        self._gen = gen
        self.index = index
        self._record = record
        self._start = record.start
        self._length = record.length
        self.rng_state = record.rng_state  # the global RNG state the step's call started with (what it drew from)

    @property
    def trace(self) -> Trace:
        """The step's trace, named ``"step k"`` (a step a fork replayed is captured again the first time
        it is asked for)."""
        trace = self._record.trace
        if trace.name == "trace":  # the default name: say which step it is (in reprs and drawings)
            trace.name = f"step {self.index}"
        return trace

    @property
    def replayed(self) -> bool:
        """Whether a fork computed this step from its parent's records (layers below the edit read, not run)."""
        return bool(getattr(self._record, "replayed", False))

    @property
    def positions(self) -> range:
        """The absolute positions this step computed (rows of its sequence axis, in order)."""
        if self._length is None:
            raise PositionNotInStepError(
                f"step {self.index}'s model call took no token ids or embeddings of shape (batch, sequence, ...), "
                "so its positions are unknown", step=self.index,
                remedy="Pass input_ids (or inputs_embeds) to the model in your loop, or read rows yourself.")
        return range(self._start, self._start + self._length)

    @property
    def ops(self) -> list[Site]:
        return self.trace.layers

    @property
    def modules(self) -> Any:
        return self.trace.modules

    @property
    def output(self) -> Any:
        """What the model returned at this step (edits included)."""
        return self._record.output

    @property
    def logits(self) -> torch.Tensor | None:
        """The model's logits at the step's last position, ``(batch, vocab)``: what the next token is
        chosen from (before the decoding code's processors such as temperature or top-k)."""
        logits = _logits_of(self._record.output)
        return None if logits is None else logits[:, -1]

    @property
    def token(self) -> torch.Tensor | None:
        """The token chosen from this step's logits, ``(batch,)`` (None: no token followed it)."""
        p = self.positions.stop
        seq = self._gen.sequences
        if seq is None or p < self._gen.prompt_length or p >= seq.shape[1]:
            return None
        return seq[:, p]

    def __getitem__(self, key: str | int) -> Site:
        return self.trace[key]

    def _repr_html_(self) -> str:
        return self.trace._repr_html_()

    def to_dot(self, **options: Any) -> str:
        """The DOT source of this step's graph (the options of ``Trace.to_dot``: depth, focus, rolled, highlight)."""
        return self.trace.to_dot(**options)

    def draw(self, path: Any = None, **options: Any) -> Any:
        """Draw this step's executed graph: ``Trace.draw`` of ``step.trace`` (its ops, module calls and edits).

        Args:
            path: where to write the picture (.svg/.png/.pdf/.dot); None: only return the Drawing.
            **options: ``fmt``, ``depth``, ``focus``, ``rolled``, ``highlight``, as ``Trace.draw`` takes them.

        Returns:
            a ``tl.Drawing`` (``.dot``, ``.path``, ``.svg()``; shown inline by Jupyter).

        Raises:
            InvalidArgumentError: the step was captured without an op graph (``backend="hooks"``).
            GraphvizNotFoundError: a picture file was asked for and Graphviz's ``dot`` is missing.
        """
        return self.trace.draw(path, **options)

    def read(self, site: Any, *, position: int | None = None) -> Any:
        """The value at ``site`` in this step (what a forward hook sees), optionally at one absolute position.

        Raises:
            PositionNotInStepError: the step did not compute ``position``.
            SiteNotFoundError: the site names nothing in the step's trace.
        """
        inner, _ = split_step(site)
        value = _read(self.trace, inner)
        if position is None:
            return value
        return _at_row(value, self._row(position))

    def _row(self, position: int) -> int:
        positions = self.positions
        if position not in positions:
            owner = self._gen.steps_computing(position)
            raise PositionNotInStepError(
                f"step {self.index} computed positions {positions.start}..{positions.stop - 1}, not {position}"
                + (f"; position {position} was computed at step(s) {owner}" if owner else ""),
                step=self.index, position=position)
        return position - positions.start

    def __repr__(self) -> str:
        token = self.token
        shown = "" if token is None else f", token {token.tolist()}"
        where = f"positions {self._start}..{self._start + self._length - 1}" if self._length else "positions unknown"
        deferred = not getattr(self._record, "materialized", True)  # its trace is not captured yet: not now either
        ops = f"{self._record.kind}, captured when read" if deferred else f"{len(self.trace.ops)} ops"
        return f"<GenerationStep {self.index}: {where}{shown}, {ops}>"


class StepList:
    """``gen.steps``: index it (``gen.steps[3]``, ``[-1]``, a slice), iterate it, ``len`` it."""

    def __init__(self, steps: list[GenerationStep]) -> None:
        self._steps = steps

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[GenerationStep]:
        return iter(self._steps)

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return self._steps[k]
        n = len(self._steps)
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidArgumentError(f"gen.steps[...] takes a step index or a slice, got {type(k).__name__}")
        if not -n <= k < n:
            raise StepNotFoundError(f"step {k} is beyond the generation's {n} step(s) (0..{n - 1})", step=k, n_steps=n)
        return self._steps[k]

    def __repr__(self) -> str:
        return f"<StepList {len(self)} steps>"


class GenerationTrace:
    """One generation: its token ids, and per step (``gen.steps[k]``) a trace of that forward.

    Reads take a site (every step) or ``tl.at_step(site, k | range | list)``: ``gen.read(site)``
    is ``{step: value}``, ``gen.read(tl.at_step(site, 3))`` step 3's value; ``position=p`` keeps the
    row of absolute position ``p`` (reading only the steps that computed it).
    """

    def __init__(self, model: Any, records: list[StepRecord], *, output: Any, prompt_length: int,
                 run: GenerationRun, edits: list[tuple[Any, StepSet, Any]]) -> None:
        self.model = model
        self._set(records, output)
        self.prompt_length = prompt_length
        self.run = run  # how it was made (inputs, decoding, capture settings): what a fork re-runs
        self.edits = list(edits)  # (site, steps, edit) applied while generating

    def _set(self, records: list[StepRecord], output: Any) -> None:
        self.records = list(records)
        self.output = output  # what generate (or the loop) returned
        seq = getattr(output, "sequences", output)
        self.sequences: torch.Tensor | None = seq if isinstance(seq, torch.Tensor) else None
        self.steps = StepList([GenerationStep(self, k, r) for k, r in enumerate(records)])

    @property
    def tokenizer(self) -> Any:
        return self.run.tokenizer

    def compare(self, other: GenerationTrace, *, atol: float = 1e-5, rtol: float = 1e-4) -> GenerationComparison:
        """This generation and ``other`` step by step: where logits first differ (that step's traces
        compared op by op, as ``tl.debug.compare``), and where the text diverges.

        Raises:
            InvalidArgumentError: ``other`` is not a generation, or the prompts differ in length.
        """
        return compare_generations(self, other, atol=atol, rtol=rtol)

    def fork(self) -> Any:
        """A branch of this generation to edit after the fact: ``gen.fork().do(tl.at_step(site, k), edit)``.

        Returns:
            a :class:`GenerationFork`; this generation is never changed.
        """
        return GenerationFork(self)

    @property
    def tokens(self) -> torch.Tensor | None:
        """The generated token ids, ``(batch, new tokens)``: ``sequences`` after the prompt."""
        return None if self.sequences is None else self.sequences[:, self.prompt_length:]

    @property
    def text(self) -> list[str]:
        """Each row of ``sequences`` decoded by the tokenizer given to ``tl.generate``.

        Raises:
            InvalidArgumentError: no tokenizer was given.
        """
        if self.tokenizer is None:
            raise InvalidArgumentError("this generation has no tokenizer to decode its text",
                                       remedy="Pass tokenizer= to tl.generate, or decode gen.sequences yourself.")
        return self.tokenizer.batch_decode(self.sequences, skip_special_tokens=True)

    def __len__(self) -> int:
        return len(self.steps)

    def step_trace(self, k: int) -> Trace:
        """Step ``k``'s trace; what ``tl.patch_from(gen)`` reads at step ``k`` of another generation.

        Raises:
            StepNotFoundError: ``k`` is beyond this generation's steps.
        """
        return self.steps[k].trace

    def draw(self, step: int, path: Any = None, **options: Any) -> Any:
        """Draw step ``step``'s graph: ``gen.steps[step].draw(path, **options)``.

        Raises:
            StepNotFoundError: ``step`` is beyond this generation's steps (the error says how many ran).
        """
        return self.steps[step].draw(path, **options)

    def steps_computing(self, position: int) -> list[int]:
        """The steps that computed absolute ``position`` (one with a KV cache; every later one without)."""
        return [s.index for s in self.steps if s._length is not None and position in s.positions]

    def read(self, site: Any, *, position: int | None = None) -> Any:
        """The value at ``site`` per step, as a forward hook on a plain generate sees it at each call.

        Args:
            site: a site (every step) or ``tl.at_step(site, steps)``.
            position: keep only the row of this absolute position (sequence axis 1 of the value,
                or of its first tensor); steps that did not compute it are left out.

        Returns:
            ``{step: value}``; for ``tl.at_step(site, k)`` with one int ``k``, that step's value.

        Raises:
            StepNotFoundError: a step named is beyond the generation's steps.
            PositionNotInStepError: ``tl.at_step(site, k)`` names a step that did not compute ``position``.
            SiteNotInStepError: ``site`` is in an encoder-decoder model's encoder (run once, before step 0).
            ValueNotSavedError: ``save=`` did not keep ``site`` at a step read (the step is named).
        """
        inner, steps = split_step(site)
        if self.run.loop is None:
            check_outside_encoder(self.model, [inner])
        chosen = steps.resolve(len(self.steps))
        out = {}
        for k in chosen:
            step = self.steps[k]
            if position is not None and position not in step.positions and not steps.single:
                continue
            try:
                out[k] = step.read(inner, position=position)
            except ValueNotSavedError as err:
                raise ValueNotSavedError(
                    f"{inner.describe()} at step {k} was recorded but not kept: this generation's save= "
                    f"({self.run.keep!r:.120}) does not keep it at step {k} ({err.message})", step=k,
                    site=inner.describe(), remedy=f"Generate again with save= including {inner.describe()} at "
                    f"step {k} (tl.at_step(site, {k}), or the plain site for every step), or save=None.") from err
            except SiteNotFoundError as err:
                if isinstance(err, SiteNotInStepError):
                    raise
                ran = self.steps_running(inner)
                if not ran:
                    raise
                raise SiteNotInStepError(f"{inner.describe()} did not run at step {k}; it ran at step(s) {ran}",
                                         step=k, steps=ran, site=inner.describe()) from err
        return out[chosen[0]] if steps.single else out

    def steps_running(self, site: Any) -> list[int]:
        """The steps at which ``site`` ran (a site of the prompt pass only: ``[0]``)."""
        inner, _ = split_step(site)
        found = []
        for step in self.steps:
            try:
                step.trace.find_sites(step.trace.bind(inner, strings_as_modules=True))
            except SiteError:
                continue
            found.append(step.index)
        return found

    __getitem__ = read

    def _repr_html_(self) -> str:
        """The generated tokens, each a link to the row of the step that chose it, then a row per step."""
        def word(ids: torch.Tensor) -> str:
            shown = str(ids.tolist()) if self.tokenizer is None else self.tokenizer.decode(ids)
            return escape(shown)

        anchor = f"tl-gen-{id(self):x}-step"
        tokens = "" if self.tokens is None else " ".join(
            f'<a href="#{anchor}-{k}" title="step {k}: position {self.prompt_length + k}">'
            f"<b>{word(self.tokens[:, k])}</b></a>" for k in range(self.tokens.shape[1]))
        rows = []
        for step in self.steps:
            token = step.token
            where = "?" if step._length is None else f"{step.positions.start}..{step.positions.stop - 1}"
            if getattr(step._record, "materialized", True):
                counts = (f"<td>{len(step.trace.ops)}</td><td>{len(step.trace.calls)}</td>"
                          f"<td>{len(step.trace.edits)}</td>")
            else:  # a fork's step not captured yet: showing it does not capture it
                counts = f"<td colspan=3>{step._record.kind}, captured when read</td>"
            rows.append(f'<tr id="{anchor}-{step.index}"><td>{step.index}</td><td>{where}</td>'
                        f"<td>{'-' if token is None else word(token)}</td>{counts}</tr>")
        head = "".join(f"<th>{h}</th>" for h in ("step", "positions", "token", "ops", "module calls", "edits"))
        return (f'<div class="tl-box"><b>GenerationTrace</b>: {len(self.steps)} steps, prompt '
                f"{self.prompt_length} tokens<p>{tokens}</p><details open><summary>steps (gen.steps[k]; "
                f"gen.steps[k].draw() pictures one)</summary><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(rows)}</tbody></table></details></div>")

    def __repr__(self) -> str:
        new = None if self.tokens is None else self.tokens.shape[1]
        return f"<GenerationTrace {len(self.steps)} steps, prompt {self.prompt_length} tokens, {new} new>"


class GenerationFork(GenerationTrace):
    """A branch of a generation; ``do`` edits it at some steps and replays the steps after them.

    The steps before the first step an edit reaches are the parent's (shared, not re-run). That
    step runs with the edit, resuming Hugging Face ``generate`` from a copy of the parent's KV cache
    cut back to it, with the random number generator as it was then. Each later step whose input
    token is the parent's is replayed: only the blocks from the edited one on run, on its new
    position, reading the changed KV rows; the blocks below are read from the parent's records.
    From the first step whose token differs, the whole model runs again, for real. A decoding
    loop, no KV cache, a cache that cannot be cut back or a batch row that already ended
    re-executes instead. ``record`` (a :class:`~torchlens.generation.fork.ForkRecord`) says which
    steps were reused, replayed, edited and regenerated, which blocks ran, why replay did not
    apply, and where the text first diverged.
    """

    def __init__(self, parent: GenerationTrace) -> None:
        super().__init__(parent.model, parent.records, output=parent.output, prompt_length=parent.prompt_length,
                         run=parent.run, edits=parent.edits)
        self.parent = parent
        self.record: ForkRecord | None = None

    def do(self, site: Any, edit: Any) -> GenerationFork:
        """Apply ``edit`` at ``site`` (a plain site: every step; ``tl.at_step(site, k | range | list)``)
        and recompute the generation from the first step it reaches (replayed while the tokens stay
        the parent's, regenerated from the first that differs).

        Returns:
            this fork, for chaining; ``fork.record`` describes what was replayed and re-run.

        Raises:
            StepNotFoundError: the edit's first step is beyond this generation's steps.
            StepEditShapeError: the edit does not fit the activation at some step.
        """
        triple = edit_triple(site, edit)
        records, output, record = rerun(self, triple)
        self._set(records, output)
        self.edits = [*self.edits, triple]
        self.record = record
        return self


def _read(trace: Trace, selector: Any) -> Any:
    """A site's value in one step's trace: a module's output as a hook sees it, an op's output;
    a selector matching several sites gives a list."""
    sel = trace.bind(selector, strings_as_modules=True)
    paths = sel.module_paths()
    if paths is not None and len(paths) == 1:
        return trace.module_output(trace.module_call(paths[0]))
    found = trace.find_sites(sel)
    return found.first().out if len(found) == 1 else [s.out for s in found]


def _at_row(value: Any, row: int) -> Any:
    """Row ``row`` of the sequence axis (axis 1) of a tensor, or of a structured value's first tensor."""
    tensor = first_tensor(value)
    if tensor is None:
        raise InvalidArgumentError("the site holds no tensor to read a position of")
    return tensor[:, row]
