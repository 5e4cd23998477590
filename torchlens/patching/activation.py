"""Activation patching grids (layer × position, layer × head [× position]) and what they share
with causal tracing (:mod:`torchlens.patching.causal`): scoring cells, restoring rows, batched cells.

Every cell of a grid is one fork of the corrupted (or noised) trace with one value restored
from the clean run; the fork replays only the rows the edit can reach
(``torchlens.edit._slicing``), so a cell costs a fraction of a forward instead of one
forward; on short prompts through bidirectional attention the cells run instead as the entries
of one batch (``torchlens.edit._cells``, the rule in :func:`_batched_decision`). Results are
:class:`PatchingResult` objects: a labelled tensor (``.values``, its
``.dims`` and ``.labels``) with ``.plot()`` (a heatmap, matplotlib optional).

Sites are canonical names (``tl.arch``): ``"resid_pre"``, ``"resid_mid"``, ``"resid_post"``,
``"attn"``, ``"mlp"`` (one row per block), or ``"heads"`` (layer × head, through the
fused-attention facets, ``torchlens.mechinterp.patch_head``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._progress import track
from ..analysis import plots
from ..analysis._workflow_inputs import as_trace, model_of
from ..analysis.heads import head_patch_site
from ..arch.resolve import arch
from ..capture._random import refuse_random
from ..core.indices import python_indices
from ..core.records import ModuleCall
from ..core.steps import REPLAY, Step
from ..core.trace import Trace
from ..core.tree import first_tensor, flatten, unflatten
from ..edit._cells import mixes_back, plan_cells, run_cells, site_index
from ..edit._fallbacks import declare
from ..edit.edits import EditContext
from ..edit.reads import OutputRead, replay_reads
from ..errors import GuardChangedError, InvalidArgumentError, TokenNotFoundError
from .metrics import MetricReads, logits_of, metric_position, score

__all__ = ["BATCHED_TOKENS", "CAUSAL_BATCHED_TOKENS", "KINDS", "PatchingResult", "activation_patching", "restore_rows",
           "site_kind_remedy"]

# Cells replayed together by default: enough to share most weight reads of a sweep's few-row
# recomputations, few enough that the batch's recomputed rows stay well under one trace per cell.
DEFAULT_BATCH = 16
# Grids on prompts of at most this many tokens (batch x positions) run their cells as batch entries
# (``torchlens.edit._cells``): measured by bench/bench_encoder_grid.py, see _batched_decision.
BATCHED_TOKENS = 32
# Through causal attention, grids whose metric reads the whole output row (no declared partial read:
# each sliced cell then reads the LM head whole) batch on prompts of at most this many tokens.
CAUSAL_BATCHED_TOKENS = 16
KINDS = ("resid_pre", "resid_mid", "resid_post", "attn", "mlp", "heads")


@dataclass
class PatchingResult:
    """A labelled result tensor: ``values[i, j, ...]`` for ``labels[dims[0]][i]``, ``labels[dims[1]][j]`` ...
    (one axis per dim; three for heads at each position: ``("layer", "head", "position")``).

    ``clean`` and ``corrupted`` are the metric on the unpatched runs, so
    ``normalized()`` gives the share of the clean–corrupted gap a patch restores.

    ``estimate`` is set by attribution patching only: the raw first-order change of the metric,
    ``((clean_act - corrupted_act) * grad).sum(-1)`` with the gradient of the metric at the
    corrupted run (what TransformerLens-style code computes); its ``values`` are then
    ``corrupted + estimate``, on the scale of exact patching's values.
    """

    values: torch.Tensor
    dims: tuple[str, ...]
    labels: dict[str, list[Any]]
    metric: str
    clean: float | None = None
    corrupted: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    estimate: torch.Tensor | None = None

    def normalized(self) -> torch.Tensor:
        """``(values - corrupted) / (clean - corrupted)``: 1 restores the clean metric, 0 changes nothing.

        Raises:
            InvalidArgumentError: the clean and corrupted metrics are unknown or equal.
        """
        if self.clean is None or self.corrupted is None or self.clean == self.corrupted:
            raise InvalidArgumentError("normalising needs different clean and corrupted metrics",
                                       remedy="Read .values, or pick prompts whose metric differs.")
        return (self.values - self.corrupted) / (self.clean - self.corrupted)

    def plot(self, *, title: str = "", normalized: bool | None = None, tokens: Sequence[str] | None = None,
             tokenizer: Any = None) -> Any:
        """A heatmap of the result (rows: the first dim, columns: the second).

        By default the share of the clean–corrupted gap each patch restores (:meth:`normalized`),
        when both baselines are known and differ; see :func:`torchlens.analysis.plots.patching_grid`.

        Args:
            title: the figure title.
            normalized: True: plot :meth:`normalized`; False: the raw metric values; None (default):
                normalised when both baselines are known and differ.
            tokens: the prompt's token strings, one per position: they label the position axis.
            tokenizer: decodes the prompt's token ids the workflow kept (``notes["ids"]``, the
                clean run's) into the position labels, one ``tokenizer.decode([id])`` per position.

        Returns:
            the matplotlib Figure.

        Raises:
            InvalidArgumentError: ``normalized=True`` without two different baselines; ``tokens`` or
                ``tokenizer`` on a result without a position axis, too few tokens, or a tokenizer
                without kept ids.
            OptionalDependencyError: matplotlib is not installed.
        """
        return plots.patching_grid(self, title=title, normalized=normalized, tokens=tokens, tokenizer=tokenizer)

    def __repr__(self) -> str:
        return f"<PatchingResult {self.metric} over {' × '.join(self.dims)} {tuple(self.values.shape)}>"


# -- scoring cells ---------------------------------------------------------------------------


class _Cells:
    """Scores patched forks of one trace, ``batch_size`` cells replayed together (their row
    recomputations stacked: ``Trace.forks``). When the metric declares what it reads
    (:class:`MetricReads`) and the logits come straight from a linear LM head, cells replay
    with ``replay_reads``: the head computes only those logits (the log says ``"read"``)."""

    def __init__(self, trace: Trace, metric: Callable[[Any], Any], batch_size: int) -> None:
        self.trace, self.metric, self.batch_size = trace, metric, batch_size
        self.read = _output_read(trace, metric)
        self.sites: dict[str, Any] = {}

    def score_all(self, cells: Iterable[tuple[str, str, Any]]) -> Iterator[float]:
        """The score of each ``(fork name, site, edit)`` cell, in order, ``batch_size`` at a time.

        The cells of a batch replay together: those whose edits change the same rows (one
        position) in one pass over the graph (``torchlens.edit._sweep`` groups them), the rest
        op by op in step; callers order cells position by position so a batch holds few groups.
        """
        for chunk in _chunks(cells, self.batch_size):
            yield from self._score_together(chunk)

    def _score_together(self, cells: list[tuple[str, Any, Any]]) -> list[float]:
        # a cell restoring several sites passes them as its site: a list of (site, edit) pairs (edit None)
        if self.read is None or any(isinstance(site, list) for _, site, _ in cells):
            forks = self.trace.forks([site if isinstance(site, list) else (site, edit) for _, site, edit in cells],
                                     names=[c[0] for c in cells])
            return [score(self.metric, f.output) for f in forks]
        steps = [Step(self._bound(site), edit, REPLAY) for _, site, edit in cells]
        got = replay_reads([self.trace.fork(name) for name, _, _ in cells], steps, self.read)
        scores = []
        for (name, site, edit), value in zip(cells, got):
            if isinstance(value, GuardChangedError):  # fork.do re-executes the real forward (and warns)
                scores.append(score(self.metric, self.trace.fork(name).do(site, edit).output))
            elif isinstance(value, BaseException):
                raise value
            else:
                scores.append(score(self.metric.reads.score, value))
        return scores

    def score_sites(self, sites: list[tuple[str, list[tuple[str, Any]]]]) -> list[list[float] | str]:
        """Per site, the scores of its ``(fork name, edit)`` cells, or why they cannot be batched.

        The sites that can be batched run as one growing batch (``torchlens.edit._cells.run_cells``),
        ``batch_size`` cells of each site at a time: a chain of at most ``batch_size`` × sites entries,
        each holding only the values its later ops still read. A cell whose edit leaves the site's
        value as recorded (restoring a row both runs share) scores the trace's own output, as
        its sliced fork would, without a batch entry. A site whose cells reach an op
        ``torch.vmap`` refused while running gets that refusal as its reason (all its cells then
        replay as forks)."""
        plans = [self._plan(site) for site, _ in sites]
        out: list[list[float] | str] = [p if isinstance(p, str) else [] for p in plans]
        ok = sorted((i for i, p in enumerate(plans) if not isinstance(p, str)), key=lambda i: plans[i].site)
        if not ok:
            return out
        unchanged: list[float] = []  # the trace's own score, computed once
        width = max(len(sites[i][1]) for i in ok)
        for start in range(0, width, self.batch_size):
            chain, cells, values = [], [], []
            for i in ok:
                recorded, ctx = self.trace.value(plans[i].site), self._context(sites[i][0])
                scores, keep, edited = out[i], [], []
                if isinstance(scores, str):
                    continue
                for name, edit in sites[i][1][start:start + self.batch_size]:
                    value = edit(recorded, ctx=ctx)
                    if isinstance(value, torch.Tensor) and torch.equal(value, recorded):
                        unchanged = unchanged or [score(self.metric, self.trace.output)]
                        scores.append(unchanged[0])
                    else:
                        scores.append(None)  # filled in below, in order
                        keep.append(name)
                        edited.append(value)
                if keep:
                    chain.append(i)
                    cells.append(keep)
                    values.append(edited)
            if not chain:
                continue
            got = run_cells(self.trace, [plans[i] for i in chain], values, cells)
            ran = [i for i, g in zip(chain, got) if not isinstance(g, str)]
            read = all(plans[i].read is not None for i in ran) and len({plans[i].read for i in ran}) == 1
            for i, scores in zip(chain, got):
                if isinstance(scores, str):
                    out[i] = scores
                    continue
                todo = iter(score(self.metric.reads.score if read else self.metric, g) for g in scores)
                out[i] = [next(todo) if s is None else s for s in out[i]]
        return out

    def mixes_back(self, layer: int) -> bool | str:
        """Whether block ``layer`` carries an edit of the last position back to the first (bidirectional
        attention), measured on the trace (``torchlens.edit._cells.mixes_back``); a str: cannot tell."""
        plan = self._plan(f"blocks.{layer}.resid_pre", read=False)
        records = self._bound(f"blocks.{layer}.resid_post").match(self.trace)
        end = site_index(self.trace, records[0]) if len(records) == 1 else "no single resid_post"
        if isinstance(plan, str) or isinstance(end, str):
            return plan if isinstance(plan, str) else end
        return mixes_back(self.trace, plan, end)

    def _plan(self, site: str, read: bool = True) -> Any:
        records = self._bound(site).match(self.trace)
        if len(records) != 1:
            return f"{site} matches {len(records)} places in the trace"
        return plan_cells(self.trace, records[0], self.read if read else None)

    def _context(self, site: str) -> EditContext:
        """The ``ctx`` an edit of ``site`` receives (as replay passes it: a head patch reads its op)."""
        record = self._bound(site).match(self.trace)[0]
        if isinstance(record, ModuleCall):
            return EditContext(site, record.label, record.address, record.pass_index, record, self.trace)
        return EditContext(site, record.label, record.module, record.module_pass, record, self.trace)

    def _bound(self, site: str) -> Any:
        bound = self.sites.get(site)
        if bound is None:
            bound = self.sites[site] = self.trace.bind(site, strings_as_modules=True)
        return bound


def _output_read(trace: Trace, metric: Callable[[Any], Any]) -> OutputRead | None:
    reads = getattr(metric, "reads", None)
    if not isinstance(reads, MetricReads) or not trace.has_op_graph:
        return None
    logits = logits_of(trace.output)
    if logits.dim() != 3:
        return None
    for ref in trace.output_refs:
        if ref is not None and ref.elem is None and trace.value(ref.index) is logits:
            return OutputRead(ref.index, 1, metric_position(reads.position, logits.shape[1]), reads.columns)
    return None


# -- edits -----------------------------------------------------------------------------------


def restore_rows(donor: Any, positions: Sequence[int] | int | None, *, axis: int = 1) -> Callable[..., Any]:
    """An edit that copies ``donor``'s rows at ``positions`` (along ``axis``) into the activation.

    Args:
        donor: the clean value of the site (a tensor, or a module's tuple output whose first
            tensor is used).
        positions: a position, a list of positions, or None (every position).
        axis: the sequence axis.

    Returns:
        ``edit(activation, *, ctx)`` for ``fork.do`` / ``tl.when``.
    """
    source = first_tensor(donor)
    index = None if positions is None else [positions] if isinstance(positions, int) else list(positions)

    def edit(activation: Any, *, ctx: Any) -> Any:
        leaves, spec = flatten(activation)
        k = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        out = leaves[k].clone()
        if index is None:
            out.copy_(source)
        else:
            idx = torch.tensor(_positions(index, out.shape[axis]), device=out.device)
            out.index_copy_(axis, idx, source.index_select(axis, idx))
        leaves[k] = out
        return unflatten(leaves, spec)

    edit.may_change_nothing = True  # restoring a position where both runs agree is a legitimate no-op
    return edit


# -- activation patching ------------------------------------------------------------------------


def _layers(model: Any, kind: str, layers: Sequence[int] | None) -> list[int]:
    """The blocks a workflow covers (``ArchView.layer_indices``: ``-1`` is the last block)."""
    return arch(model).layer_indices(layers, "attn" if kind == "heads" else kind)


def _token_positions(positions: Any, clean: Trace, corrupted: Trace) -> Any:
    """``positions`` with token strings (``" Paris"``) replaced by their position: found in the clean
    prompt, else in the corrupted one, at the same position in every prompt of the batch.

    Raises:
        TokenNotFoundError / AmbiguousTokenError: the string is in neither prompt, or occurs twice.
        InvalidArgumentError: the prompts of a batch hold it at different positions.
    """
    if positions is None or not any(isinstance(p, str) for p in ([positions] if isinstance(positions, (int, str))
                                                                  else positions)):
        return positions
    items = [positions] if isinstance(positions, str) else list(positions)
    return [p if not isinstance(p, str) else _token_position(p, clean, corrupted) for p in items]


def _token_position(token: str, clean: Trace, corrupted: Trace) -> int:
    try:
        source, found = clean, {clean.position(token, row=r) for r in range(len(clean.str_tokens))}
    except TokenNotFoundError as missing:
        try:
            source, found = corrupted, {corrupted.position(token, row=r) for r in range(len(corrupted.str_tokens))}
        except TokenNotFoundError:
            raise missing from None
    if len(found) > 1:
        raise InvalidArgumentError(f"token {token!r} sits at positions {sorted(found)} in different prompts of the "
                                   f"{source.name} batch; a patching position is one column for every prompt",
                                   remedy="Give the position as an int.")
    return found.pop()


def _positions(positions: Sequence[int] | int | None, seq: int) -> list[int]:
    """Sequence positions, ``-1`` the last; outside the prompt refused, never wrapped."""
    if positions is None:
        return list(range(seq))
    return python_indices(positions, seq, what="position", axis=f"the prompt has {seq} positions")


# TransformerLens's spellings of a grid's site (its hook names, its get_act_patch_* suffixes) -> the kind here
_TL_KINDS = {"resid_pre": "resid_pre", "resid_mid": "resid_mid", "resid_post": "resid_post", "attn_out": "attn",
             "mlp_out": "mlp", "z": "heads", "attn_head_out": "heads", "result": "heads"}


def site_kind_remedy(site: Any, kinds: Sequence[str]) -> str:
    """What to pass as ``site=`` instead of ``site``: the kind a TransformerLens spelling
    (``"hook_attn_out"``, ``"blocks.3.hook_resid_pre"``, ``"z"``) or a canonical name (``"blocks.3.mlp"``) means."""
    text = site if isinstance(site, str) else ""
    block = re.match(r"^blocks\.(\d+)\.(?:attn\.)?", text)
    tail = text[block.end():] if block else text
    kind = _TL_KINDS.get(tail.removeprefix("hook_")) or (tail if tail in kinds else None)
    if kind is None or kind not in kinds:
        return f"site= names a kind of site, one per block: one of {tuple(kinds)}."
    layers = f", layers=[{block.group(1)}]" if block else ""
    return f"site={kind!r}{layers}: site= names a kind of site (one per block), the rows are picked with layers=."


def _check_pair(clean: Trace, corrupted: Trace, metric: Any = None) -> None:
    """Inputs of one shape; and a built-in metric's read position is a real token of every prompt.

    Raises:
        InvalidArgumentError: inputs of different shapes; a metric (``logit_diff``, ``prob``) reading a
            position that is padding in some row (right-padded prompts of different lengths read at -1).
    """
    a, b = first_tensor(clean.args or tuple(clean.kwargs.values())), \
        first_tensor(corrupted.args or tuple(corrupted.kwargs.values()))
    if a is not None and b is not None and a.shape != b.shape:
        raise InvalidArgumentError(
            f"clean and corrupted inputs differ in shape ({tuple(a.shape)} vs {tuple(b.shape)}); patching copies "
            "values position by position", remedy="Use prompts of the same token length (pad or choose them so).")
    reads = getattr(metric, "reads", None)
    for which, trace in (("clean", clean), ("corrupted", corrupted)):
        mask = (trace.kwargs or {}).get("attention_mask")
        if not isinstance(reads, MetricReads) or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            continue
        at = metric_position(reads.position, mask.shape[-1])
        padded = (mask[:, at] == 0).nonzero().flatten().tolist()
        if padded:
            raise InvalidArgumentError(
                f"the metric reads position {reads.position} ({at}), which is padding in row(s) {padded} of the "
                f"{which} prompts: it would score the logits of a pad token",
                remedy="Pad on the left (tokenizer.padding_side = 'left') so the last position is a real token in "
                "every row, or give the metric a position every prompt has (logit_diff(a, b, position=...)).")


def activation_patching(clean: Any, corrupted: Any, metric: Callable[[Any], Any], *, model: Any = None,
                        site: str = "resid_pre", layers: Sequence[int] | None = None,
                        positions: Sequence[int | str] | int | str | None = None, progress: bool | None = None,
                        batch_size: int = DEFAULT_BATCH, tokenizer: Any = None,
                        batched_cells: bool | None = None) -> PatchingResult:
    """Patch each (layer, position) — or each (layer, head [, position]) — from the clean run into the corrupted one.

    Each cell is a fork of ``corrupted`` with one clean value restored and replayed on the
    rows it reaches; ``values[cell]`` is ``metric`` of that fork's output. On short prompts
    through bidirectional attention (an encoder), the cells instead run as the entries of one
    batch over the recorded graph, each layer's cells joining it at that layer
    (``batched_cells``); ``notes["cells"]`` says which was used and why.

    Args:
        clean: the clean trace (``tl.trace(model, ids)``), or its inputs with ``model=``: token
            ids, or a string / list of strings (tokenized with ``tokenizer``).
        corrupted: the corrupted trace, or its inputs with ``model=`` (as ``clean``).
        metric: ``metric(model_output) -> scalar`` (e.g. :func:`logit_diff`, :func:`prob`).
        model: the model, when ``clean``/``corrupted`` are inputs.
        site: one of ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn``, ``mlp`` (a layer ×
            position grid) or ``heads``: a layer × head grid (each head's output at every
            position), or with ``positions=`` a layer × head × position grid (one head's output
            at one position: its slice of the output projection's input, that row).
        layers: which blocks (default: all); negative ones count from the end (``-1``: the last).
        positions: which positions (default: all; for ``heads``, every position at once);
            negative ones count from the end; a token string (``" Paris"``) names the position
            of that token in the clean prompt (else the corrupted one), when it occurs once.
        progress: show a progress bar (None: when stderr is a terminal).
        batch_size: how many cells replay together (``Trace.forks``: one read of each weight per
            batch instead of per cell). Each cell of a batch holds its recomputed rows until the
            batch is scored — at most one trace's values per cell — so this bounds the memory.
        tokenizer: tokenizes text prompts (default: the model's ``tokenizer`` attribute); the
            traces made keep it, so ``positions`` may be token strings (as with traces made with
            ``tl.trace(model, text, tokenizer=tok)``).
        batched_cells: None (default): batch the cells (``batch_size`` positions of every layer at a
            time) when the prompts hold at most :data:`BATCHED_TOKENS` tokens and the model's
            blocks carry an edit of the last position back to the first, where it was measured
            to win; True: batch
            wherever the graph allows; False: never. A layer the batch cannot take (a guard, an
            in-place write or an op ``torch.vmap`` cannot batch its edit reaches, such as ``x[mask]``)
            replays as forks, its reason in ``notes["cells"]["declined"]``. Head grids follow the
            same rule (each layer's heads are cells of its attention op).

    Returns:
        a :class:`PatchingResult` with dims ``("layer", "position")``, ``("layer", "head")`` or
        (heads with ``positions=``) ``("layer", "head", "position")``, ``values`` of that shape,
        ``labels`` giving each axis' block indices, heads and positions (non-negative);
        ``notes["cells"]`` says whether the cells were batched and why.

    Raises:
        InvalidArgumentError: unknown ``site``, traces without a model, inputs of different
            lengths, a position outside the prompt, ``batched_cells`` not a bool or None.
        SiteNotFoundError: a layer out of range, or a site the model's adapter does not give its blocks
            (the error names the adapter and the sites it has).
        TokenizerRequiredError: text prompts, or token-string positions, and no tokenizer.
        TokenNotFoundError / AmbiguousTokenError: a token-string position absent from the prompts,
            or occurring twice.
    """
    if site not in KINDS:
        raise InvalidArgumentError(f"site= is one of {KINDS}, got {site!r}", remedy=site_kind_remedy(site, KINDS))
    _check_batch(batch_size)
    _check_batched(batched_cells)
    clean, corrupted = as_trace(model, clean, "clean", tokenizer), as_trace(model, corrupted, "corrupted", tokenizer)
    _check_pair(clean, corrupted, metric)
    refuse_random("activation patching", clean, corrupted)
    model = model if model is not None else model_of(corrupted, clean)
    corrupted.ensure_graph()  # once here, not once per fork
    rows = _layers(model, site, layers)
    name = getattr(metric, "__name__", "metric")
    base_clean, base_corrupted = score(metric, clean.output), score(metric, corrupted.output)
    scorer = _Cells(corrupted, metric, batch_size)
    positions = _token_positions(positions, clean, corrupted)
    if site == "heads":  # without positions=, each head at every position (no sequence length needed)
        at = None if positions is None else _positions(positions, _seq_len(corrupted))
        decision = _batched_decision(corrupted, batched_cells, scorer, rows[0])
        values, dims, labels = _head_grid(clean, corrupted, scorer, rows, arch(model).n_heads, at, progress, decision)
        return PatchingResult(values, dims, labels, name, base_clean, base_corrupted,
                              {"ids": _prompt_ids(clean), "cells": decision})
    cols = _positions(positions, _seq_len(corrupted))
    values = torch.empty(len(rows), len(cols))
    donors = {layer: clean[f"blocks.{layer}.{site}"].out for layer in rows}
    decision = _batched_decision(corrupted, batched_cells, scorer, rows[0])
    if decision["batched"]:  # the cells of each layer join one growing batch at that layer's value
        got = scorer.score_sites([(f"blocks.{layer}.{site}", [
            (f"{corrupted.name}/patch[{layer}.{site}@{p}]", restore_rows(donors[layer], p)) for p in cols])
            for layer in rows])
        for i, (layer, scores) in enumerate(zip(rows, got)):
            if isinstance(scores, str):  # (raises with TORCHLENS_STRICT_FALLBACKS=1, so a test sees it)
                decision["declined"][layer] = declare("batched cells", scores)[1]
            else:
                values[i] = torch.tensor(scores, dtype=values.dtype)
    done = set(rows) - set(decision["declined"]) if decision["batched"] else set()
    # position by position: the cells of one position change the same rows, and replay in one pass
    cells = [(i, layer, j, p) for j, p in enumerate(cols) for i, layer in enumerate(rows) if layer not in done]
    todo = ((f"{corrupted.name}/patch[{layer}.{site}@{p}]", f"blocks.{layer}.{site}", restore_rows(donors[layer], p))
            for _, layer, _, p in track(cells, desc=f"patching {site}", unit="cell", progress=progress))
    for (i, _, j, _), got in zip(cells, scorer.score_all(todo)):
        values[i, j] = got
    return PatchingResult(values, ("layer", "position"), {"layer": rows, "position": cols}, name, base_clean,
                          base_corrupted, {"ids": _prompt_ids(clean), "cells": decision})


def _batched_decision(corrupted: Trace, batched: bool | None, scorer: _Cells, layer: int,
                      any_attention: str | None = None) -> dict[str, Any]:
    """Whether a grid's cells run as batch entries (``torchlens.edit._cells``), and why: the
    record kept in ``notes["cells"]`` (``"declined"`` gains each layer the batch could not take).

    The rule, measured by ``bench/bench_encoder_grid.py`` on one CPU thread: batch when the
    prompts hold at most :data:`BATCHED_TOKENS` tokens in all *and* the model's blocks carry an
    edit of the last position back to the first (bidirectional attention: an encoder), so a cell
    recomputes every row after its first block. A cell's rows then cost the read of each weight,
    which the batch shares (BERT-base, 12 layers x 8 positions, traces excluded: 8 tokens 0.20-0.26
    of a forward per cell against 0.42-0.61 sliced; 32 tokens 0.35-0.38 against 0.51-0.54; 64
    tokens 0.47-0.49 against 0.47-0.52, even). Under causal attention slicing
    recomputes only the rows at and after the patched position and wins from 16 tokens on
    (GPT-2 small, ``logit_diff``, 8 positions, traces excluded: 16 tokens 0.14 sliced against
    0.20 batched, 32 tokens 0.14-0.17 against 0.22); at 8 tokens batching is ahead by 10-20%
    (0.095 against 0.084), too little to split the rule for such metrics. A metric that reads the
    whole output row (no declared partial read: a probability, a user function) makes every sliced
    cell read the LM head whole, so through causal attention it batches on prompts of at most
    :data:`CAUSAL_BATCHED_TOKENS` tokens (GPT-2 small, the correct token's probability, 8 positions,
    traces included, ``--whole-row``: 8 tokens 0.20 batched against 0.26 sliced, 16 tokens 0.20
    against 0.27, 32 tokens 0.26 against 0.23). Head grids follow the same rule
    (BERT-base 1 x 8, 12 x 12 heads, traces included: 0.28 of a forward per cell batched against
    1.28-1.58 sliced, at 3 positions 0.18 against 1.45-1.60; GPT-2 small 1 x 8: 0.15 against 0.17
    for whole heads, 0.046 against 0.048 at 3 positions).

    ``any_attention``: a workflow measured to gain from batching through causal attention too
    (causal tracing), named in the reason; the prompt length alone then decides.
    """
    ids = first_tensor(corrupted.args or tuple(corrupted.kwargs.values()))
    tokens = None if ids is None or ids.dim() < 2 else ids.shape[0] * ids.shape[1]
    if batched is None:
        batched = tokens is not None and tokens <= BATCHED_TOKENS
        reason = (f"{tokens} tokens {'<=' if batched else '>'} {BATCHED_TOKENS}" if tokens is not None
                  else "unknown prompt length")
        if batched and any_attention:
            reason += f"; {any_attention}"
        elif batched:
            mixes = scorer.mixes_back(layer)
            batched = mixes is True
            reason += ("; attention is bidirectional" if batched else "; attention is causal" if mixes is False
                       else f"; cannot tell whether attention is causal: {mixes}")
            whole_row = scorer.read is None or scorer.read.columns is None  # every sliced cell reads the LM head whole
            if mixes is False and whole_row and tokens <= CAUSAL_BATCHED_TOKENS:
                batched = True
                reason += (f", but the metric reads the whole output row and {tokens} tokens "
                           f"<= {CAUSAL_BATCHED_TOKENS}")
    else:
        reason = f"batched_cells={batched}"
    return {"batched": batched, "reason": reason, "declined": {}}


def _head_grid(clean: Trace, corrupted: Trace, scorer: _Cells, rows: list[int], n_heads: int,
               positions: list[int] | None, progress: bool | None, decision: dict[str, Any],
               ) -> tuple[torch.Tensor, tuple[str, ...], dict[str, list[int]]]:
    """The layer × head grid (each head's output at every position), or the layer × head ×
    position grid when ``positions`` are given (one head's output at one position): values,
    dims and labels. With ``decision["batched"]`` the heads of each layer are the cells of one
    site (the attention op whose per-head output they edit) in one growing batch; a layer the
    batch cannot take joins ``decision["declined"]`` and replays as forks."""
    heads = list(range(n_heads))
    at = [None] if positions is None else positions
    values = torch.empty(len(rows), n_heads, len(at))

    def cell(layer: int, h: int, p: int | None) -> tuple[str, str, Any]:
        label, edit = head_patch_site(corrupted, layer, h, clean, positions=None if p is None else [p])
        edit.may_change_nothing = True  # restoring a head (row) where both runs agree is a legitimate no-op
        return f"{corrupted.name}/patch_head[{layer}.{h}.output{'' if p is None else f'@{p}'}]", label, edit

    done: set[int] = set()
    if decision["batched"]:  # one site per layer; its cells position by position, head by head
        sites = []
        for layer in rows:
            made = [cell(layer, h, p) for p in at for h in heads]
            sites.append((made[0][1], [(n, e) for n, _, e in made]))
        for i, (layer, scores) in enumerate(zip(rows, scorer.score_sites(sites))):
            if isinstance(scores, str):  # (raises with TORCHLENS_STRICT_FALLBACKS=1, so a test sees it)
                decision["declined"][layer] = declare("batched cells", scores)[1]
            else:
                values[i] = torch.tensor(scores, dtype=values.dtype).view(len(at), n_heads).T
                done.add(layer)
    # position by position, head by head: one head's patches at every layer change the same part of their values
    cells = [(i, layer, h, j, p) for j, p in enumerate(at) for h in heads for i, layer in enumerate(rows)
             if layer not in done]
    todo = (cell(layer, h, p) for _, layer, h, _, p in track(cells, desc="patching heads", unit="cell",
                                                             progress=progress))
    for (i, _, h, j, _), got in zip(cells, scorer.score_all(todo)):
        values[i, h, j] = got
    if positions is None:
        return values[..., 0], ("layer", "head"), {"layer": rows, "head": heads}
    return values, ("layer", "head", "position"), {"layer": rows, "head": heads, "position": positions}


def _check_batch(batch_size: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size= is a whole number of cells >= 1, got {batch_size!r}",
                                   remedy="Lower it to use less memory, raise it to share more weight reads.")


def _check_batched(batched: Any) -> None:
    if batched is not None and not isinstance(batched, bool):
        raise InvalidArgumentError(f"batched_cells= is True, False or None, got {batched!r}",
                                   remedy="None picks by the prompt and the model; True or False forces the choice.")


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _prompt_ids(trace: Trace) -> list[int] | None:
    """The first prompt's token ids (kept in a result's ``notes["ids"]`` to label its positions)."""
    ids = first_tensor(trace.args or tuple(trace.kwargs.values()))
    if ids is None or ids.dim() != 2 or ids.dtype.is_floating_point:
        return None
    return [int(i) for i in ids[0]]


def _seq_len(trace: Trace) -> int:
    ids = first_tensor(trace.args or tuple(trace.kwargs.values()))
    if ids is None or ids.dim() < 2:
        raise InvalidArgumentError("cannot tell the sequence length of this trace's input",
                                   remedy="Capture with token ids of shape [batch, positions].")
    return ids.shape[1]
