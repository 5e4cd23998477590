"""Logit lens: each block's residual stream read through the final norm and the unembedding.

``logit_lens(trace)`` takes the output of every block (``blocks.{i}``, the residual stream
after it), applies the model's final norm (found from the trace: the module whose output
feeds the unembedding, through shape-only ops) and the unembedding (``unembed``), and returns
the logits per layer and position, with the top tokens (as strings when a tokenizer is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..arch.resolve import arch
from ..core.records import ModuleCall
from ..core.trace import Trace
from ..core.tree import first_tensor
from ..errors import InvalidArgumentError, SiteNotFoundError
from . import plots
from .patching import _as_trace, _model_of

__all__ = ["LogitLens", "find_final_norm", "logit_lens"]

# Ops between the final norm and the unembedding that only move values around.
_PASS_THROUGH = frozenset({"view", "reshape", "getitem", "contiguous", "to", "float", "flatten", "dropout"})


@dataclass
class LogitLens:
    """Logits ``[layer, batch, position, vocab]`` of each block's residual stream.

    ``layers`` labels the first axis; ``norm`` is the final-norm module address applied ('' for none).
    """

    logits: torch.Tensor
    layers: list[int]
    norm: str
    tokenizer: Any = None

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
                                layers=[f"blocks.{i}" for i in self.layers], title=title)

    def __repr__(self) -> str:
        return f"<LogitLens {len(self.layers)} layers, logits {tuple(self.logits.shape)}, norm {self.norm!r}>"


def find_final_norm(trace: Trace) -> str:
    """The address of the module whose output feeds the unembedding ('' when there is none).

    Raises:
        SiteNotFoundError: the unembedding did not run in this trace.
    """
    model = _model_of(trace)
    unembed = arch(model).resolve("unembed")
    calls = trace.calls_of(unembed)
    if not calls or not trace.has_op_graph:
        raise SiteNotFoundError(f"the unembedding {unembed!r} did not run in this trace (or no ops were recorded)",
                                site="unembed", remedy="Capture with tl.trace(model, ids) on the LM-head model.")
    call: ModuleCall = calls[-1]
    trace.ensure_graph()
    op = trace.ops[call.op_start] if call.op_start < len(trace.ops) else None
    refs = list(op.parent_refs) if op is not None else []
    while refs:
        parent = trace.ops[refs[0].index]
        if parent.module and not parent.module.startswith(unembed) and parent.func_name not in _PASS_THROUGH:
            return parent.module if parent.module != arch(model).blocks[-1] else ""
        if parent.func_name not in _PASS_THROUGH:
            return ""
        refs = list(parent.parent_refs)
    return ""


def logit_lens(trace: Any, inputs: Any = None, *, layers: Sequence[int] | None = None, norm: str | bool = True,
               tokenizer: Any = None) -> LogitLens:
    """Unembed every block's residual stream.

    Args:
        trace: a trace (``tl.trace(model, ids)``), or a model with ``inputs``.
        inputs: the model's input ids when ``trace`` is a model.
        layers: which blocks (default: all); negative ones count from the end (``-1``: the last).
        norm: True finds the final norm from the trace (:func:`find_final_norm`); a module
            address names it; False applies none.
        tokenizer: decodes token ids in ``top_tokens`` and plots.

    Returns:
        a :class:`LogitLens`.

    Raises:
        InvalidArgumentError: a model without inputs, or a bad ``norm``.
        SiteNotFoundError: no unembedding, or a layer out of range.
    """
    if not isinstance(trace, Trace):
        if inputs is None:
            raise InvalidArgumentError("logit_lens takes a trace, or a model and its inputs",
                                       remedy="tl.logit_lens(tl.trace(model, ids)) or tl.logit_lens(model, ids).")
        trace = _as_trace(trace, inputs, "inputs")
    model = _model_of(trace)
    view = arch(model)
    rows = view.layer_indices(layers)
    if norm is True:
        norm = find_final_norm(trace)
    elif norm is False:
        norm = ""
    elif not isinstance(norm, str):
        raise InvalidArgumentError(f"norm= is True, False or a module address, got {type(norm).__name__}")
    final = model.get_submodule(norm) if norm else None
    unembed = view.module("unembed")
    out = []
    with torch.no_grad():
        for layer in rows:
            resid = first_tensor(trace[f"blocks.{layer}"].out)
            out.append(unembed(final(resid) if final is not None else resid))
    return LogitLens(torch.stack(out), rows, norm, tokenizer)
