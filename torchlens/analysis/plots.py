"""Matplotlib figures for analysis: attention patterns, result heatmaps, logit lens.

Each function returns the matplotlib ``Figure`` (save it with ``fig.savefig(path)``; a notebook
shows it). matplotlib is an optional dependency (``pip install 'torchlens[viz]'``).

- :func:`attention_patterns`: one layer's heads as a grid of (query × key) patterns, from an
  attention facet (``tl.mechinterp.attention_at(trace, layer)``) or a tensor.
- :func:`heatmap`: any (layer × position) or (layer × head) tensor of results, on a diverging
  colour scale centred at zero or at a given baseline (patching effects, logit differences).
- :func:`logit_lens`: (layer × position) of the top token per cell, coloured by its probability.
- :func:`patching_grid`: a patching result (``PatchingResult.plot``), as the share of the
  clean–corrupted gap each patch restores, token strings on the position axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError, OptionalDependencyError

__all__ = ["attention_patterns", "heatmap", "logit_lens", "patching_grid"]


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt  # optional, heavy: only plotting needs it (headless: falls back to Agg)
    except ImportError as exc:
        raise OptionalDependencyError("plots need matplotlib, which is not installed",
                                      remedy="pip install 'torchlens[viz]' (or pip install matplotlib).") from exc
    return plt


def _as_matrix(values: Any, name: str, dims: int) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"{name} must be a tensor or nested list of numbers, got "
                                       f"{type(values).__name__}") from exc
    values = values.detach().to("cpu", torch.float32)
    if values.dim() != dims:
        raise InvalidArgumentError(f"{name} must have {dims} dimensions, got shape {tuple(values.shape)}")
    return values


def _labels(given: Sequence[Any] | None, n: int, what: str) -> list[str] | None:
    if given is None:
        return None
    labels = [str(x) for x in given]
    if len(labels) != n:
        raise InvalidArgumentError(f"{len(labels)} {what} labels for {n} {what}s")
    return labels


def attention_patterns(attention: Any, *, tokens: Sequence[str] | None = None, heads: Sequence[int] | None = None,
                       batch: int = 0, title: str | None = None, cols: int = 4) -> Any:
    """A grid of one layer's attention patterns, one panel per head (query rows × key columns).

    Args:
        attention: an attention facet (``tl.mechinterp.attention_at(trace, layer)`` or
            ``site.facets``) or a pattern tensor ``[batch, heads, q, k]`` / ``[heads, q, k]``.
        tokens: token strings for the axes (as many as positions).
        heads: which heads to show (default: all).
        batch: which batch element.
        title: the figure title.
        cols: panels per row.

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgumentError: a tensor of the wrong shape, or labels that do not match it.
        OptionalDependencyError: matplotlib is not installed.
    """
    pattern = getattr(attention, "pattern", attention)
    pattern = _as_matrix(pattern, "the attention pattern", pattern.dim() if isinstance(pattern, torch.Tensor) else 4)
    if pattern.dim() == 4:
        if not 0 <= batch < pattern.shape[0]:
            raise InvalidArgumentError(f"batch {batch} is out of range for {pattern.shape[0]} batch element(s)")
        pattern = pattern[batch]
    if pattern.dim() != 3:
        raise InvalidArgumentError(f"an attention pattern is [batch, heads, q, k] or [heads, q, k], got shape "
                                   f"{tuple(pattern.shape)}")
    n_heads, n_q, n_k = pattern.shape
    chosen = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    bad = [h for h in chosen if not 0 <= h < n_heads]
    if bad or not chosen:
        raise InvalidArgumentError(f"heads {bad or chosen} are not in 0..{n_heads - 1}")
    q_labels, k_labels = _labels(tokens[-n_q:] if tokens is not None else None, n_q, "query position"), \
        _labels(tokens, n_k, "key position")
    plt = _pyplot()
    cols = max(1, min(cols, len(chosen)))
    rows = math.ceil(len(chosen) / cols)
    side = 2.2 + 0.18 * max(n_k, 1) ** 0.5 * 4
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    image = None
    for ax, h in zip(axes.flat, chosen):
        image = ax.imshow(pattern[h].numpy(), vmin=0.0, vmax=1.0, cmap="Blues")
        ax.set_title(f"head {h}", fontsize=9)
        _ticks(ax, q_labels, k_labels)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention")
    fig.suptitle(title or getattr(attention, "label", "attention pattern"))
    return fig


def _ticks(ax: Any, rows: list[str] | None, cols: list[str] | None) -> None:
    if cols is not None:
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    else:
        ax.set_xlabel("key", fontsize=8)
    if rows is not None:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    else:
        ax.set_ylabel("query", fontsize=8)


def heatmap(values: Any, *, rows: Sequence[Any] | None = None, cols: Sequence[Any] | None = None,
            row_title: str = "layer", col_title: str = "position", title: str = "", label: str = "",
            cmap: str = "RdBu_r", center: float = 0.0, bound: float | None = None) -> Any:
    """A heatmap of a 2-D result (layer × position, layer × head ...) on a diverging scale around ``center``.

    Args:
        values: a 2-D tensor (or nested list) of numbers.
        rows: labels of the rows (default: 0, 1, ...).
        cols: labels of the columns (e.g. token strings).
        row_title: the axis title of the rows.
        col_title: the axis title of the columns.
        title: the figure title.
        label: the colour bar's label (what the numbers are).
        cmap: a diverging matplotlib colour map.
        center: the value drawn white (0; a patching result's corrupted baseline ...).
        bound: the scale spans ``center ± bound`` (default: the largest distance from ``center``).

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgumentError: not 2-D, or labels that do not match it.
        OptionalDependencyError: matplotlib is not installed.
    """
    m = _as_matrix(values, "values", 2)
    row_labels = _labels(rows, m.shape[0], "row") or [str(i) for i in range(m.shape[0])]
    col_labels = _labels(cols, m.shape[1], "column") or [str(i) for i in range(m.shape[1])]
    if bound is None:
        finite = m[torch.isfinite(m)]
        bound = float((finite - center).abs().max()) if finite.numel() else 1.0
    bound = bound or 1.0  # a constant result still gets a valid scale
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(2.8 + 0.5 * m.shape[1], 1.4 + 0.4 * m.shape[0]))
    image = ax.imshow(m.numpy(), cmap=cmap, vmin=center - bound, vmax=center + bound, aspect="auto")
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=90 if cols is not None else 0, fontsize=8)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    ax.set_xlabel(col_title)
    ax.set_ylabel(row_title)
    fig.colorbar(image, ax=ax, label=label)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def logit_lens(logits: Any, *, vocab: Sequence[str] | None = None, tokens: Sequence[str] | None = None,
               layers: Sequence[Any] | None = None, batch: int = 0, title: str = "logit lens") -> Any:
    """Logit-lens grid: for each layer (row) and position (column), the top token and its probability.

    Args:
        logits: ``[layer, position, vocab]`` (or ``[layer, batch, position, vocab]``) logits from
            unembedding each layer's residual stream.
        vocab: the token string of every vocabulary id (default: the ids).
        tokens: the input token strings, as column labels.
        layers: row labels (default: 0, 1, ...).
        batch: which batch element when ``logits`` has a batch dimension.
        title: the figure title.

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgumentError: wrong shape, or labels that do not match it.
        OptionalDependencyError: matplotlib is not installed.
    """
    t = logits.detach() if isinstance(logits, torch.Tensor) else torch.as_tensor(logits)
    if t.dim() == 4:
        t = t[:, batch]
    t = _as_matrix(t, "logits", 3)
    probs = t.softmax(-1)
    top_p, top_id = probs.max(-1)
    n_layers, n_pos = top_p.shape
    if vocab is not None and len(vocab) < t.shape[-1]:
        raise InvalidArgumentError(f"vocab has {len(vocab)} entries, the logits {t.shape[-1]}")
    row_labels = _labels(layers, n_layers, "layer") or [str(i) for i in range(n_layers)]
    col_labels = _labels(tokens, n_pos, "position") or [str(i) for i in range(n_pos)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * n_pos, 1.0 + 0.42 * n_layers))
    image = ax.imshow(top_p.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(n_layers):
        for j in range(n_pos):
            idx = int(top_id[i, j])
            text = vocab[idx] if vocab is not None else str(idx)
            ax.text(j, i, text[:10], ha="center", va="center", fontsize=7,
                    color="white" if top_p[i, j] > 0.6 else "black")
    ax.set_xticks(range(n_pos), col_labels, rotation=90 if tokens is not None else 0, fontsize=8)
    ax.set_yticks(range(n_layers), row_labels, fontsize=8)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="top-token probability")
    fig.tight_layout()
    return fig


def patching_grid(result: Any, *, title: str = "", normalized: bool | None = None,
                  tokens: Sequence[str] | None = None, tokenizer: Any = None) -> Any:
    """A patching result as a heatmap (rows: its first dim, columns: its second); ``PatchingResult.plot``.

    By default, when both baselines are known and differ, each cell is the share of the
    clean–corrupted gap its patch restores (``result.normalized()``: 0 changes nothing, 1
    restores the clean metric) on a fixed −1..1 scale (wider if a cell overshoots); otherwise
    the raw metric, centred at the corrupted run's metric when known (white: no change).

    Args:
        result: a :class:`~torchlens.patching.PatchingResult`.
        title: the figure title.
        normalized: True: the normalised share; False: the raw metric values; None (default):
            normalised when both baselines are known and differ.
        tokens: the prompt's token strings, one per position: they label the position axis.
        tokenizer: decodes the prompt's token ids the workflow kept (``result.notes["ids"]``, the
            clean run's) into the position labels, one ``tokenizer.decode([id])`` per position.

    Returns:
        the matplotlib Figure.

    Raises:
        InvalidArgumentError: ``normalized=True`` without two different baselines; ``tokens`` or
            ``tokenizer`` on a result without a position axis, too few tokens, or a tokenizer
            without kept ids.
        OptionalDependencyError: matplotlib is not installed.
    """
    if normalized is None:
        normalized = result.clean is not None and result.corrupted is not None and result.clean != result.corrupted
    rows, cols = result.dims[0], result.dims[1]
    col_labels = _position_tokens(result, tokens, tokenizer) if cols == "position" else None
    if col_labels is None and (tokens is not None or tokenizer is not None):
        raise InvalidArgumentError(f"tokens label a position axis; this result is over {' × '.join(result.dims)}",
                                   remedy="Drop tokens=/tokenizer= for a layer × head result.")
    common = {"rows": result.labels[rows], "cols": col_labels or result.labels[cols], "row_title": rows,
              "col_title": cols, "title": title}
    if normalized:
        share = _as_matrix(result.normalized(), "the normalised result", 2)
        finite = share[torch.isfinite(share)]
        bound = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        label = f"share of the clean–corrupted gap restored ({result.metric})"
        return heatmap(share, **common, bound=bound, label=label)
    center = result.corrupted if result.corrupted is not None else 0.0
    return heatmap(result.values, **common, center=center, label=result.metric)


def _position_tokens(result: Any, tokens: Sequence[str] | None, tokenizer: Any) -> list[str] | None:
    """The token string of each column's position, from ``tokens`` or the result's kept ids decoded."""
    if tokens is None and tokenizer is not None:
        ids = result.notes.get("ids")
        if ids is None:
            raise InvalidArgumentError("this result kept no prompt token ids to decode",
                                       remedy="Pass tokens= (the prompt's token strings) instead.")
        if not callable(getattr(tokenizer, "decode", None)):
            raise InvalidArgumentError(f"tokenizer= needs a decode method, got {type(tokenizer).__name__}",
                                       remedy="Pass a Hugging Face tokenizer, or tokens= as strings.")
        tokens = [tokenizer.decode([int(i)]) for i in ids]  # any object with decode(ids), not only HF's
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    positions = result.labels["position"]
    if positions and max(positions) >= len(tokens):
        raise InvalidArgumentError(f"{len(tokens)} token(s) for a result over positions up to {max(positions)}",
                                   remedy="Pass one token string per prompt position.")
    return [tokens[p] for p in positions]
