"""Patching over features: exact feature activation patching, and its first-order estimate (attribution).

``feature_patching(clean, corrupted, metric, site=..., sae=...)`` forks the corrupted run with the
dictionary attached at ``site`` and restores one feature's clean activation (at one position, or at
every position) per cell, the reconstruction error held at the corrupted run's; each cell replays
only the rows the edit reaches, several cells together (``Trace.forks``). Cells whose feature has
the same activation in both runs cannot change anything and are not run.

``feature_attribution_patching`` estimates every cell at once from one forward and one backward on
the corrupted prompt: ``(f_clean - f_corrupted) * d metric / d f``, the gradient taken through the
dictionary's decoder at the site (the error term held fixed, as exact patching holds it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._progress import track
from ..analysis._workflow_inputs import as_trace, model_of
from ..api import trace as capture
from ..arch.resolve import arch
from ..capture._random import refuse_random
from ..features.dictionary import FeatureDictionary, as_dictionary
from ..features.dla import _site_value, feature_activations
from .activation import (
    DEFAULT_BATCH,
    PatchingResult,
    _Cells,
    _check_batch,
    _check_pair,
    _positions,
    _prompt_ids,
    _seq_len,
    _token_positions,
)
from .attribution import _differentiable, _graph_from_embeddings
from .metrics import score

__all__ = ["feature_attribution_patching", "feature_patching", "restore_features"]


def restore_features(donor: torch.Tensor, feature: int, positions: list[int] | None) -> Callable[..., Any]:
    """An edit of ``<site>.features`` copying ``donor``'s activation of ``feature`` (at ``positions``, dim -2).

    Returns:
        ``edit(activation, *, ctx)`` for ``fork.do`` / ``tl.when``.
    """

    def edit(activation: torch.Tensor, *, ctx: Any) -> torch.Tensor:
        out = activation.clone()
        if positions is None:
            out[..., feature] = donor[..., feature].to(out.dtype)
        else:
            out[..., positions, feature] = donor[..., positions, feature].to(out.dtype)
        return out

    edit.may_change_nothing = True  # restoring a feature where both runs agree is a legitimate no-op
    return edit


def _pair(clean: Any, corrupted: Any, model: Any, site: Any, sae: Any,
          metric: Any) -> tuple[Any, Any, Any, FeatureDictionary]:
    clean, corrupted = as_trace(model, clean, "clean"), as_trace(model, corrupted, "corrupted")
    _check_pair(clean, corrupted, metric)
    model = model if model is not None else model_of(corrupted, clean)
    return clean, corrupted, model, as_dictionary(sae)


def _codes(trace: Any, site: Any, dictionary: FeatureDictionary) -> tuple[torch.Tensor, str]:
    return feature_activations(trace, site, dictionary), _site_value(trace, site)[1]


def _wanted(dictionary: FeatureDictionary, features: Any, d_sae: int) -> list[int]:
    return dictionary.check_feature(features) if features is not None else list(range(d_sae))


def _cells_shape(positions: Any, clean: Any, corrupted: Any) -> tuple[list[int] | None, tuple[str, ...]]:
    positions = _token_positions(positions, clean, corrupted)
    if positions is None:
        return None, ("feature",)
    return _positions(positions, _seq_len(corrupted)), ("feature", "position")


def feature_patching(clean: Any, corrupted: Any, metric: Callable[[Any], Any], *, site: Any, sae: Any,
                     model: Any = None, features: Any = None, positions: Any = None, progress: bool | None = None,
                     batch_size: int = DEFAULT_BATCH) -> PatchingResult:
    """Restore each feature's clean activation into the corrupted run, one cell at a time, and score it.

    Args:
        clean: the clean trace (``tl.trace(model, ids)``, with or without ``features=``), or its ids with ``model=``.
        corrupted: the corrupted trace, or its ids with ``model=``.
        metric: ``metric(model_output) -> scalar`` (``tl.patching.logit_diff``, ``prob`` ...).
        site: where the dictionary reads and writes (a module output of one tensor, ``blocks.6``...).
        sae: the dictionary (anything ``tl.features.as_dictionary`` takes).
        model: the model, when ``clean``/``corrupted`` are inputs.
        features: which features (default: every one; those equal in both runs are not run).
        positions: None: each feature restored at every position at once (dims ``("feature",)``);
            positions (ints, ``-1`` the last, or token strings): one cell per feature and position
            (dims ``("feature", "position")``).
        progress: a progress bar (None: when stderr is a terminal).
        batch_size: cells replayed together.

    Returns:
        A :class:`~torchlens.patching.PatchingResult`: ``values`` are the metric of each patched run.

    Raises:
        FeatureWidthError, FeatureDtypeError, FeatureSiteError: the site does not fit the dictionary.
        FeatureIndexError: a feature out of range.
        InvalidArgumentError: traces without a model, prompts of different lengths, a position outside them.
    """
    _check_batch(batch_size)
    clean, corrupted, model, dictionary = _pair(clean, corrupted, model, site, sae, metric)
    refuse_random("feature patching", clean, corrupted)
    donor, name = _codes(clean, site, dictionary)
    mine, _ = _codes(corrupted, site, dictionary)
    wanted = _wanted(dictionary, features, donor.shape[-1])
    cols, dims = _cells_shape(positions, clean, corrupted)
    attached = capture(model, *corrupted.args, features={site: dictionary}, **corrupted.kwargs)
    attached.ensure_graph()
    base_clean, base_corrupted = score(metric, clean.output), score(metric, corrupted.output)
    at = [None] if cols is None else cols
    values = torch.full((len(wanted), len(at)), base_corrupted)
    differs = (donor != mine).reshape(-1, *donor.shape[-2:]).any(0)  # [position, d_sae]
    cells = [(i, f, j, p) for j, p in enumerate(at) for i, f in enumerate(wanted)
             if bool(differs[:, f].any() if p is None else differs[p, f])]
    target = f"{name}.features"
    todo = ((f"{attached.name}/patch[{target}#{f}{'' if p is None else f'@{p}'}]", target,
             restore_features(donor, f, None if p is None else [p]))
            for _, f, _, p in track(cells, desc="patching features", unit="cell", progress=progress))
    for (i, _, j, _), got in zip(cells, _Cells(attached, metric, batch_size).score_all(todo)):
        values[i, j] = got
    labels = {"feature": wanted} if cols is None else {"feature": wanted, "position": cols}
    return PatchingResult(values[:, 0] if cols is None else values, dims, labels,
                          getattr(metric, "__name__", "metric"), base_clean, base_corrupted,
                          {"ids": _prompt_ids(clean), "site": name, "skipped": len(wanted) * len(at) - len(cells)})


def feature_attribution_patching(clean: Any, corrupted: Any, metric: Callable[[Any], Any], *, site: Any, sae: Any,
                                 model: Any = None, features: Any = None, positions: Any = None) -> PatchingResult:
    """Estimate :func:`feature_patching` for every feature from one forward and one backward.

    Each cell's estimate is ``(f_clean - f_corrupted) * d metric / d f`` summed over the batch (and,
    with ``positions=None``, over positions), the gradient of the metric at the corrupted run taken
    through the dictionary's ``decode`` with the reconstruction error held fixed. Exact when the
    metric is linear in the site and the decoder is linear; a first-order estimate otherwise:
    compare with :func:`feature_patching` on a sample before trusting it.

    The arguments are those of :func:`feature_patching` (without ``progress`` and ``batch_size``);
    ``metric`` must return a differentiable scalar tensor.

    Returns:
        A :class:`~torchlens.patching.PatchingResult`: ``estimate`` the first-order change per cell,
        ``values`` the corrupted metric plus it (on the scale of :func:`feature_patching`'s values).

    Raises:
        InvalidArgumentError: a metric that is not a differentiable scalar; as :func:`feature_patching`.
        FeatureWidthError, FeatureDtypeError, FeatureSiteError, FeatureIndexError: as :func:`feature_patching`.
    """
    clean, corrupted, model, dictionary = _pair(clean, corrupted, model, site, sae, metric)
    refuse_random("feature attribution patching", clean, corrupted, model=model)
    donor, name = _codes(clean, site, dictionary)
    wanted = _wanted(dictionary, features, donor.shape[-1])
    cols, dims = _cells_shape(positions, clean, corrupted)
    handles = _graph_from_embeddings(arch(model))
    try:
        with torch.enable_grad():
            # the one forward, the dictionary spliced in: the error term and the clean reconstruction are
            # detached there, so the gradient reaching the features is through the decoder alone
            traced = capture(model, *corrupted.args, grad=True, features={site: dictionary}, **corrupted.kwargs)
            value = _differentiable(metric(traced.output))
            f = traced[f"{name}.features"].out
            (grad,) = torch.autograd.grad(value, [f])  # the one backward
    finally:
        for h in handles:
            h.remove()
    contrib = ((donor - f.detach()) * grad).reshape(-1, *donor.shape[-2:]).sum(0)  # [position, d_sae]
    index = torch.tensor(wanted, dtype=torch.long)
    estimate = (contrib.sum(0)[index] if cols is None else contrib[cols][:, index].T).detach().float()
    base_clean, base_corrupted = score(metric, clean.output), float(value.detach())
    labels = {"feature": wanted} if cols is None else {"feature": wanted, "position": cols}
    return PatchingResult(estimate + base_corrupted, dims, labels, getattr(metric, "__name__", "metric"), base_clean,
                          base_corrupted, {"estimate": "first-order (attribution patching)", "ids": _prompt_ids(clean),
                                           "site": name}, estimate=estimate)
