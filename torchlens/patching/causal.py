"""ROME causal tracing: noise the subject's embeddings, restore one clean state per cell.

Each noised run is a trace; each cell restores one site (or ``window`` blocks) at one position in
every run and averages the probability of the answer (Meng et al. 2022). Cells replay as sliced
forks or, on short prompts, as batched cells (``torchlens.edit._cells``), with the scoring and
the rule of :mod:`torchlens.patching.activation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._progress import track
from ..api import trace as capture
from ..arch.resolve import arch
from ..capture._random import refuse_random
from ..core.text import HOW_TO_PASS, decode_tokens, input_ids_of, is_text, text_inputs, token_position, tokenizer_for
from ..edit._fallbacks import declare
from ..edit.edits import when
from ..errors import InvalidArgumentError, TokenizerRequiredError
from .activation import (
    DEFAULT_BATCH,
    KINDS,
    PatchingResult,
    _batched_decision,
    _Cells,
    _check_batch,
    _check_batched,
    _chunks,
    _layers,
    _positions,
    restore_rows,
)
from .metrics import logits_of, prob, score

__all__ = ["causal_trace"]

# Causal tracing batches short prompts through causal attention too (its reason in notes["cells"]): its
# metric is a probability, the LM head's whole row of the last position per cell, which a batch reads
# once for all its cells. bench/bench_encoder_grid.py --causal-trace, GPT-2 small, 3 noised runs, per
# cell and run, traces included: 8 tokens 0.18-0.20 of a forward batched against 0.28-0.33 sliced, 16
# tokens 0.18 against 0.25, 32 tokens 0.25-0.26 against 0.24 (even); BERT-base MLM 8 tokens 0.18 against 0.38.
_CAUSAL_TRACE_BATCHES = "causal tracing batches through causal attention too (measured)"


def causal_trace(model: Any, ids: torch.Tensor | str, subject: Sequence[int | str] | int | str, *,
                 answer: int | None = None,
                 kinds: Sequence[str] = ("resid_post", "attn", "mlp"), noise: float | None = None,
                 samples: int = 3, seed: int = 1, layers: Sequence[int] | None = None, window: int = 1,
                 progress: bool | None = None, batch_size: int = DEFAULT_BATCH,
                 tokenizer: Any = None, batched_cells: bool | None = None) -> dict[str, PatchingResult]:
    """ROME causal tracing: noise the subject tokens' embeddings, restore one clean state at a time.

    The corrupted runs add ``noise`` × a standard normal to the token embeddings (``embed``) of
    the ``subject`` positions, one run per sample; each cell restores the clean value of one
    site at one position in every noised run and records the probability of ``answer`` at
    the last position, averaged over the samples (Meng et al. 2022, "Locating and Editing
    Factual Associations in GPT"). The noise of sample ``s`` is row ``s`` of
    ``torch.randn(samples, len(subject), d_model, generator=torch.Generator().manual_seed(seed))``.

    Args:
        model: a causal language model with an architecture adapter.
        ids: token ids ``[1, positions]``, or the prompt as a string (tokenized with ``tokenizer``).
        subject: the positions of the subject tokens (negative ones count from the end), or token
            strings (``" Paris"``, with a tokenizer) each occurring once in the prompt.
        answer: the token whose probability is traced (default: the clean run's top token).
        kinds: which sites to restore: ``resid_post`` (block outputs), ``attn``, ``mlp``.
        noise: the noise scale (default: 3 × the standard deviation of the token embeddings, as in ROME).
        samples: how many noised runs to average.
        seed: the seed of the noise.
        layers: which blocks (default: all); negative ones count from the end.
        window: how many consecutive blocks each cell restores, as ROME's figures (``window=10``
            for ``mlp`` and ``attn``): the cell of layer ``L`` restores, at its position, blocks
            ``max(0, L - window // 2)`` to ``min(n_layers, L - (-window // 2)) - 1`` (ROME's
            ``trace_important_window``). 1 (default): that block alone.
        progress: show a progress bar.
        batch_size: how many cells of one noised run replay together (as in :func:`activation_patching`).
        tokenizer: tokenizes a text prompt and finds token-string subjects (default: the model's
            ``tokenizer`` attribute).
        batched_cells: None (default) batches each noised run's cells when the prompt holds at
            most :data:`BATCHED_TOKENS` tokens, through causal attention too (measured: the
            probability metric reads the LM head's whole last row, which a batch reads once for
            all its cells); True batches wherever the graph allows; False never. A cell of
            ``window`` > 1 restores several blocks, which one batch entry cannot: those grids
            replay as forks.

    Returns:
        ``{kind: PatchingResult}`` over ``("layer", "position")``; ``clean`` is the clean
        probability and ``corrupted`` the noised one (``notes["answer"]`` the traced token,
        ``notes["window"]`` the window, ``notes["cells"]`` whether the cells were batched and why).

    Raises:
        InvalidArgumentError: bad ``ids``, ``subject`` (a position outside the prompt, or named twice), ``kinds``
            or ``window`` (not a whole number >= 1).
        SiteNotFoundError: a layer out of range, or a kind the model's adapter does not give its blocks.
        TokenizerRequiredError: a text prompt or token-string subject and no tokenizer.
        TokenNotFoundError / AmbiguousTokenError: a subject token string absent from the prompt, or
            occurring twice.
    """
    tokenizer = tokenizer_for(model, tokenizer)
    if is_text(ids):
        ids = input_ids_of(*text_inputs(ids, model, tokenizer))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        raise InvalidArgumentError("causal_trace takes token ids of shape [1, positions], or one string")
    seq = ids.shape[1]
    subject = _positions(_subject_positions(subject, ids, tokenizer), seq)
    if not subject:
        raise InvalidArgumentError("subject= lists at least one position")
    if len(set(subject)) != len(subject):  # one noise row per listed position: a repeat would drop one of them
        raise InvalidArgumentError(f"subject= names a position twice ({subject}, as non-negative positions)",
                                   remedy="List each subject position once (negative ones count from the end).")
    _check_batch(batch_size)
    _check_batched(batched_cells)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidArgumentError(f"window= is a whole number of blocks >= 1, got {window!r}",
                                   remedy="Pass window=1 to restore one block per cell, or e.g. window=10 as ROME.")
    bad = [k for k in kinds if k not in KINDS or k == "heads"]
    if bad:
        raise InvalidArgumentError(f"kinds {bad} are not among {KINDS[:-1]}")
    rows_of = {kind: _layers(model, kind, layers) for kind in kinds}  # checked before any capture
    view = arch(model)
    embed = view.module("embed")
    clean = capture(model, ids)
    refuse_random("causal tracing", clean)
    if answer is None:
        answer = int(logits_of(clean.output)[0, -1].argmax())
    if noise is None:
        noise = 3 * float(embed.weight.detach().std())
    draws = torch.randn(samples, len(subject), view.d_model, generator=torch.Generator().manual_seed(seed))
    noised = []
    for s in range(samples):
        add = (noise * draws[s]).to(embed.weight.dtype)

        def noisy(act: torch.Tensor, *, ctx: Any, add: torch.Tensor = add) -> torch.Tensor:
            out = act.clone()
            out[0, subject] += add
            return out

        noised.append(capture(model, ids, intervene=when("embed", noisy)))
        noised[-1].ensure_graph()
    metric = prob(answer)
    base_clean = score(metric, clean.output)
    base_noised = sum(score(metric, t.output) for t in noised) / samples
    scorers = [_Cells(t, metric, batch_size) for t in noised]
    if window > 1 and batched_cells is not False:  # (raises with TORCHLENS_STRICT_FALLBACKS=1 when asked for)
        why = f"window={window}: a cell restores {window} blocks, and a batch entry edits one site"
        rule = {"batched": False, "reason": declare("batched cells", why)[1] if batched_cells else why}
    else:
        rule = _batched_decision(noised[0], batched_cells, scorers[0], rows_of[kinds[0]][0], _CAUSAL_TRACE_BATCHES)
    results = {}
    for kind in kinds:
        rows = rows_of[kind]
        spans = {layer: _window(layer, window, view.n_layers) for layer in rows}
        donors = {b: clean[f"blocks.{b}.{kind}"].out for b in sorted({b for span in spans.values() for b in span})}
        values = torch.zeros(len(rows), seq)
        decision = {"batched": rule["batched"], "reason": rule["reason"], "declined": {}}
        done = _batched_trace(scorers, kind, rows, seq, donors, values, decision) if decision["batched"] else set()
        # one position at a time (one pass)
        cells = [(i, layer, p) for p in range(seq) for i, layer in enumerate(rows) if layer not in done]
        for chunk in _chunks(track(cells, desc=f"causal trace {kind}", unit="cell", progress=progress), batch_size):
            totals = [0.0] * len(chunk)
            for scorer in scorers:
                todo = [_restore_cell(scorer.trace.name, kind, spans[layer], p, donors) for _, layer, p in chunk]
                for k, got in enumerate(scorer.score_all(todo)):
                    totals[k] += got
            for (i, _, p), total in zip(chunk, totals):
                values[i, p] = total / samples
        results[kind] = PatchingResult(values, ("layer", "position"), {"layer": rows, "position": list(range(seq))},
                                       f"p({answer})", base_clean, base_noised,
                                       {"answer": answer, "noise": noise, "subject": subject, "window": window,
                                        "ids": [int(i) for i in ids[0]], "cells": decision})
    return results


def _batched_trace(scorers: list[_Cells], kind: str, rows: list[int], seq: int, donors: dict[int, Any],
                   values: torch.Tensor, decision: dict[str, Any]) -> set[int]:
    """Causal tracing's cells of ``kind`` (every position of each layer in ``rows``) as batched cells,
    one growing batch per noised run: ``values`` gets their mean over the runs; the layers done.
    A layer any run cannot batch joins ``decision["declined"]`` (its cells then replay as forks)."""
    sums = torch.zeros_like(values)
    done = set(rows)
    for scorer in scorers:
        sites = [(f"blocks.{layer}.{kind}", [(_restore_cell(scorer.trace.name, kind, [layer], p, donors)[0],
                                              restore_rows(donors[layer], p)) for p in range(seq)]) for layer in rows]
        for i, (layer, scores) in enumerate(zip(rows, scorer.score_sites(sites))):
            if isinstance(scores, str):  # (raises with TORCHLENS_STRICT_FALLBACKS=1, so a test sees it)
                decision["declined"].setdefault(layer, declare("batched cells", scores)[1])
                done.discard(layer)
            else:
                sums[i] += torch.tensor(scores, dtype=sums.dtype)
    for i, layer in enumerate(rows):
        if layer in done:
            values[i] = sums[i] / len(scorers)
    return done


def _subject_positions(subject: Any, ids: torch.Tensor, tokenizer: Any) -> Any:
    """``subject`` with token strings replaced by their one position in the prompt ``ids``."""
    items = [subject] if isinstance(subject, (int, str)) else list(subject)
    if not any(isinstance(s, str) for s in items):
        return subject
    if tokenizer is None:
        named = next(s for s in items if isinstance(s, str))
        raise TokenizerRequiredError(f"subject= names tokens as strings ({named!r}) and no tokenizer is known to "
                                     "find them", remedy=HOW_TO_PASS)
    row = decode_tokens(ids, tokenizer)[0]
    return [token_position(row, s) if isinstance(s, str) else s for s in items]


def _window(layer: int, window: int, n_layers: int) -> list[int]:
    """The blocks a causal-tracing cell of ``layer`` restores (ROME's ``trace_important_window``)."""
    return list(range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2))))


def _restore_cell(name: str, kind: str, span: list[int], p: int, donors: dict[int, Any]) -> tuple[str, Any, Any]:
    """A causal-tracing cell restoring ``kind`` of the blocks ``span`` at position ``p``, first block
    first: one ``(name, site, edit)``, or several sites as a list of ``(site, edit)`` pairs."""
    pairs = [(f"blocks.{b}.{kind}", restore_rows(donors[b], p)) for b in span]
    label = f"{span[0]}" if len(span) == 1 else f"{span[0]}-{span[-1]}"
    if len(pairs) == 1:
        return f"{name}/restore[{label}.{kind}@{p}]", *pairs[0]
    return f"{name}/restore[{label}.{kind}@{p}]", pairs, None
