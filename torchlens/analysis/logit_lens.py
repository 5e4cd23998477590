"""Logit lens: the residual stream at every layer boundary read through the final norm and the unembedding.

``logit_lens(trace)`` takes the ``n_layers + 1`` rows of ``accumulated_resid`` (row 0 the
embeddings' output, row ``L`` the output of block ``L-1``: TransformerLens's rows), applies the
model's final norm (found from the trace: the module mapping the final residual to the unembedding's input,
``residual.final_stage``: the final norm, or BERT's whole LM-head transform,
through shape-only ops) and the unembedding (``unembed``) once over the stacked rows, and
returns the logits per row and position, with the top tokens (as strings when a tokenizer is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..arch.resolve import arch
from ..errors import InvalidArgumentError
from . import plots
from ._workflow_inputs import model_of
from .residual import _boundary, _final_norm, _trace_of, find_final_norm, resid_labels

__all__ = ["LogitLens", "find_final_norm", "logit_lens"]

@dataclass
class LogitLens:
    """Logits ``[row, batch, position, vocab]`` of the residual stream at each layer boundary.

    ``layers`` labels the first axis with layer-boundary indices (0: the embeddings' output,
    ``L``: block ``L-1``'s output, ``n_layers``: the final residual); ``labels`` names them as
    TransformerLens does (``0_pre`` ... ``final_post``); ``norm`` is the final-norm module
    address applied ('' for none); ``softcap`` the final logit soft-capping applied after the
    unembedding, as the model's forward applies it (Gemma 2/3's ``final_logit_softcapping``), or None.
    """

    logits: torch.Tensor
    layers: list[int]
    norm: str
    tokenizer: Any = None
    labels: list[str] | None = None
    softcap: float | None = None

    def top(self, k: int = 5, *, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most probable token ids and their probabilities, ``[layer, position, k]`` each."""
        probs = self.logits[:, batch].float().softmax(-1)
        p, ids = probs.topk(k, dim=-1)
        return ids, p

    def top_tokens(self, k: int = 1, *, batch: int = 0) -> list[list[list[str]]]:
        """The top ``k`` tokens per layer and position as strings (needs ``tokenizer=``).

        Raises:
            InvalidArgumentError: no tokenizer was given.
        """
        if self.tokenizer is None:
            raise InvalidArgumentError("top_tokens needs tokenizer= (logit_lens(..., tokenizer=tok))",
                                       remedy="Pass a tokenizer, or read token ids with .top(k).")
        ids, _ = self.top(k, batch=batch)
        return [[[self.tokenizer.decode([int(t)]) for t in cell] for cell in row] for row in ids]

    def plot(self, *, tokens: Sequence[str] | None = None, batch: int = 0, title: str = "logit lens") -> Any:
        """The top token per layer and position, coloured by its probability (``tl.plots.logit_lens``).

        Raises:
            OptionalDependencyError: matplotlib is not installed.
        """
        vocab = None
        if self.tokenizer is not None:
            vocab = [self.tokenizer.decode([i]) for i in range(self.logits.shape[-1])]
        return plots.logit_lens(self.logits[:, batch], vocab=vocab, tokens=tokens,
                                layers=self.labels or [str(i) for i in self.layers], title=title)

    def __repr__(self) -> str:
        return f"<LogitLens {len(self.layers)} rows, logits {tuple(self.logits.shape)}, norm {self.norm!r}>"


def logit_lens(trace: Any, inputs: Any = None, *, layers: Sequence[int] | int | None = None,
               norm: str | bool = True, tokenizer: Any = None) -> LogitLens:
    """Unembed the residual stream at every layer boundary (``n_layers + 1`` rows, row 0 the embeddings).

    The rows are TransformerLens's ``accumulated_resid()``: the result equals
    ``unembed(cache.accumulated_resid(apply_ln=True))``. The final norm and the unembedding
    run once over the stacked rows (one matmul), each row normalised with its own statistics.

    Args:
        trace: a trace (``tl.trace(model, ids)``), or a model with ``inputs``.
        inputs: the model's inputs when ``trace`` is a model: token ids, or a string / list of
            strings (tokenized with ``tokenizer``).
        layers: which rows (default: all ``n_layers + 1``): 0 is the embeddings' output, ``L``
            block ``L-1``'s output; negative ones count from the end (``-1``: the final residual).
        norm: True finds the final norm from the trace (:func:`find_final_norm`); a module
            address names it; False applies none.
        tokenizer: tokenizes text ``inputs`` and decodes token ids in ``top_tokens`` and plots
            (default: the trace's, else the model's ``tokenizer`` attribute).

    Returns:
        a :class:`LogitLens`.

    Raises:
        InvalidArgumentError: a model without inputs, or a bad ``norm``.
        SiteNotFoundError: no unembedding, or a row out of range.
        TokenizerRequiredError: text ``inputs`` and no tokenizer.
    """
    trace = _trace_of(trace, inputs, "logit_lens", tokenizer)
    tokenizer = tokenizer if tokenizer is not None else getattr(trace, "tokenizer", None)
    model = model_of(trace)
    view = arch(model)
    rows = view.layer_indices(layers, boundaries=True)
    norm = _final_norm(trace, norm)
    final = model.get_submodule(norm) if norm else None
    unembed = view.module("unembed")
    with torch.no_grad():
        stack = torch.stack([_boundary(trace, view, r) for r in rows])
        logits = unembed(final(stack) if final is not None else stack)
        # the model's forward soft-caps what its LM head computes (transformers' Gemma 2/3), in this order;
        # without it the last row would not be the model's logits
        cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
            logits = torch.tanh(logits / cap) * cap
        else:
            cap = None
    return LogitLens(logits, rows, norm, tokenizer, resid_labels(view.n_layers, rows), cap)
