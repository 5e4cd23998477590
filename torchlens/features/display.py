"""Notebook displays of features: a feature's activation over tokens as a text heat-map, top features per position.

Each display is an object with the values it shows (tensors, to assert on or plot) and
``_repr_html_`` in the house notebook style (``torchlens.analysis.notebook``): the tokens of a
prompt as inline text, each shaded by the feature's activation relative to its largest in the
view, its exact value on hover; a table of the ``k`` largest features at each position; and a
feature's max-activating dataset contexts from :func:`tl.feature_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

import torch

from ..analysis.notebook import _box, _table
from ..core.text import decode_tokens, input_ids_of
from ..dictionaries.wrap import as_dictionary
from ..errors import InvalidArgumentError
from .dla import feature_activations

__all__ = ["ContextText", "FeatureText", "TopFeatures", "context_text", "feature_text", "top_features"]

_SHADE = "rgba(230,81,0,{alpha:.3f})"  # one hue: darker is more active; 0 is no shade at all
_TOKEN = ('<span title="{tip}" style="background:{bg};padding:0 1px;border-radius:2px;'
          'white-space:pre">{text}</span>')


def _token_html(text: str, value: float, top: float, tip: str) -> str:
    alpha = max(0.0, min(1.0, value / top)) if top > 0 else 0.0
    shown = text.replace("\n", "\u23ce")
    return _TOKEN.format(tip=escape(tip), bg=_SHADE.format(alpha=alpha), text=escape(shown) or "&nbsp;")


def _token_strings(trace: Any, row: int, n: int, tokens: Any, tokenizer: Any) -> list[str]:
    """The token strings of ``row``: ``tokens`` given, else the trace's ids decoded, else the ids themselves."""
    if tokens is not None:
        found = [str(t) for t in tokens]
        if len(found) != n:
            raise InvalidArgumentError(f"{len(found)} token string(s) for a prompt of {n} positions",
                                       remedy="Pass one token string per position of the traced prompt.")
        return found
    ids = input_ids_of(getattr(trace, "args", ()), getattr(trace, "kwargs", {}))
    tokenizer = tokenizer if tokenizer is not None else getattr(trace, "tokenizer", None)
    if ids is None or ids.shape[-1] != n:
        return [str(p) for p in range(n)]
    row_ids = ids.reshape(-1, ids.shape[-1])[row]
    if tokenizer is not None:
        return decode_tokens(row_ids, tokenizer)[0]
    return [str(int(i)) for i in row_ids]


def _row_codes(trace: Any, site: Any, sae: Any, row: int) -> torch.Tensor:
    codes = feature_activations(trace, site, sae)
    if codes.dim() != 3:
        raise InvalidArgumentError(f"the site's features have shape {tuple(codes.shape)}, not [batch, position, "
                                   f"d_sae]", remedy="Pick a site whose value is one vector per token.")
    if type(row) is not int or not -codes.shape[0] <= row < codes.shape[0]:
        raise InvalidArgumentError(f"row={row!r} is not a row of a batch of {codes.shape[0]}",
                                   remedy=f"Pick row between 0 and {codes.shape[0] - 1}.")
    return codes[row]


@dataclass
class FeatureText:
    """A feature's activation over tokens: ``values[i]`` at ``tokens[i]``; renders as a text heat-map."""

    feature: int
    tokens: list[str]
    values: torch.Tensor
    title: str

    def _repr_html_(self) -> str:
        top = float(self.values.max()) if self.values.numel() else 0.0
        spans = "".join(_token_html(t, float(v), top, f"position {i}: {float(v):.4g}")
                        for i, (t, v) in enumerate(zip(self.tokens, self.values)))
        facts = [("feature", str(self.feature)), ("max", f"{top:.4g}"),
                 ("active", f"{int((self.values > 0).sum())} of {len(self.tokens)} tokens")]
        return _box(escape(self.title), facts, [f'<div style="line-height:1.9">{spans}</div>'])


def feature_text(trace: Any, site: Any, sae: Any, feature: int, *, row: int = 0, tokens: Any = None,
                 tokenizer: Any = None) -> FeatureText:
    """One feature's activation at every token of a traced prompt, shown as a text heat-map in a notebook.

    Args:
        trace: a capture of the model on token ids.
        site: where the dictionary reads (as :func:`feature_logit_attrs`).
        sae: the dictionary.
        feature: the feature index.
        row: which prompt of the batch.
        tokens: the token strings to show (default: the ids decoded with ``tokenizer`` or the trace's).
        tokenizer: decodes the ids when ``tokens`` is not given.

    Raises:
        FeatureIndexError: ``feature`` out of range.
        FeatureWidthError, FeatureDtypeError: the site does not fit the dictionary.
        InvalidArgumentError: ``row`` out of range, or ``tokens`` of another length.
    """
    (feature,) = as_dictionary(sae).check_feature(feature)
    codes = _row_codes(trace, site, sae, row)
    strings = _token_strings(trace, row, codes.shape[0], tokens, tokenizer)
    name = site if isinstance(site, str) else str(site)
    return FeatureText(feature, strings, codes[:, feature].detach().float().cpu(), f"feature {feature} at {name}")


@dataclass
class TopFeatures:
    """The ``k`` largest features at each position: ``indices[p]`` and ``values[p]`` (descending)."""

    tokens: list[str]
    indices: torch.Tensor
    values: torch.Tensor
    title: str

    def _repr_html_(self) -> str:
        top = float(self.values.max()) if self.values.numel() else 0.0
        rows = []
        for p, text in enumerate(self.tokens):
            cells = "".join(
                f"<td>{_token_html(str(int(i)), float(v), top, f'feature {int(i)}: {float(v):.4g}')}</td>"
                if float(v) > 0 else "<td></td>" for i, v in zip(self.indices[p], self.values[p]))
            rows.append(f"<tr><td>{p}</td><td>{escape(text)}</td>{cells}</tr>")
        header = ("pos", "token", *[f"#{j + 1}" for j in range(self.indices.shape[1])])
        return _box(escape(self.title), [("positions", str(len(self.tokens)))], [_table(header, rows)])


def top_features(trace: Any, site: Any, sae: Any, *, k: int = 5, row: int = 0, tokens: Any = None,
                 tokenizer: Any = None) -> TopFeatures:
    """The ``k`` most active features at each position of a traced prompt, as a notebook table.

    ``trace``, ``site``, ``sae``, ``row``, ``tokens`` and ``tokenizer`` are as in :func:`feature_text`.

    Args:
        k: features per position (inactive ones are left blank in the table).

    Raises:
        InvalidArgumentError: ``k`` is not a positive int, ``row`` out of range, or ``tokens`` of another length.
        FeatureWidthError, FeatureDtypeError: the site does not fit the dictionary.
    """
    if type(k) is not int or k < 1:
        raise InvalidArgumentError(f"k must be a positive int, got {k!r}")
    codes = _row_codes(trace, site, sae, row).detach().float().cpu()
    top = codes.topk(min(k, codes.shape[-1]), dim=-1)
    strings = _token_strings(trace, row, codes.shape[0], tokens, tokenizer)
    name = site if isinstance(site, str) else str(site)
    return TopFeatures(strings, top.indices, top.values, f"top features at {name}")


@dataclass
class ContextText:
    """A feature's max-activating dataset contexts (from :func:`tl.feature_stats`), one line each."""

    feature: int
    contexts: list[dict[str, Any]]
    left: int

    def _repr_html_(self) -> str:
        top = max((c["value"] for c in self.contexts), default=0.0)
        rows = []
        for c in self.contexts:
            at = min(self.left, c["position"])  # fewer tokens before it when the row starts late
            texts = c.get("text") or [str(t) for t in c["tokens"]]
            spans = "".join(_token_html(t, c["value"] if j == at else 0.0, top,
                                        f"row {c['row']} position {c['position'] - at + j}")
                            for j, t in enumerate(texts))
            rows.append(f"<tr><td>{c['value']:.4g}</td><td>{c['row']}:{c['position']}</td><td>{spans}</td></tr>")
        return _box(f"feature {self.feature}: max-activating contexts", [("contexts", str(len(self.contexts)))],
                    [_table(("activation", "row:pos", "context"), rows)])


def context_text(stats: Any, feature: int, *, tokenizer: Any = None) -> ContextText:
    """A feature's max-activating contexts from :func:`tl.feature_stats`, the activating token shaded.

    Args:
        stats: a site's statistics (``tl.feature_stats(...)[site]``).
        feature: the feature index.
        tokenizer: decodes the context's token ids (default: the ids are shown).

    Raises:
        FeatureIndexError: ``feature`` out of range.
    """
    return ContextText(feature, stats.top_contexts(feature, tokenizer), stats.context[0])
