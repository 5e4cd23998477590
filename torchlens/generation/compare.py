"""Comparing two generations step by step: where the logits first differ, where the text diverges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..analysis.compare import compare
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from .trace import GenerationTrace

__all__ = ["GenerationComparison", "compare_generations", "first_token_difference"]


@dataclass
class GenerationComparison:
    """Two generations side by side (``gen.compare(other)``).

    ``logit_max_abs[k]`` is the largest difference of step ``k``'s logits (steps both ran);
    ``first_step_differs`` the first step whose logits differ beyond the tolerance, and
    ``step_comparison`` that step's traces compared op by op (``tl.debug.compare``), which names
    the first op that differs; ``diverged_at`` the first position whose token differs, chosen at
    ``diverged_step``, with each generation's tokens there in ``tokens``.
    """

    logit_max_abs: list[float]
    first_step_differs: int | None
    step_comparison: Any = field(repr=False)
    diverged_at: int | None
    diverged_step: int | None
    tokens: tuple[list[int], list[int]] | None

    @property
    def same(self) -> bool:
        """Same tokens, and no step's logits differ beyond the tolerance."""
        return self.diverged_at is None and self.first_step_differs is None

    def __str__(self) -> str:
        if self.same:
            return f"same text, logits within tolerance at all {len(self.logit_max_abs)} common steps"
        parts = []
        if self.first_step_differs is not None:
            k = self.first_step_differs
            parts.append(f"logits first differ at step {k} (max abs {self.logit_max_abs[k]:.3g})")
        if self.diverged_at is not None:
            parts.append(f"text diverges at position {self.diverged_at} (step {self.diverged_step}): "
                         f"{self.tokens[0]} vs {self.tokens[1]}")
        return "; ".join(parts)


def compare_generations(a: GenerationTrace, b: GenerationTrace, *, atol: float = 1e-5,
                        rtol: float = 1e-4) -> GenerationComparison:
    """Compare two generations of the same prompt length step by step.

    Args:
        a: a generation (``tl.generate``) or a fork of one.
        b: the generation to compare it with.
        atol: absolute tolerance on logits and, for the first differing step, on every op.
        rtol: relative tolerance, in the rule ``|a - b| > atol + rtol * |b|``.

    Returns:
        a :class:`GenerationComparison`.

    Raises:
        InvalidArgumentError: ``b`` is not a generation, or the prompts differ in length.
    """
    if not hasattr(b, "steps") or not hasattr(b, "prompt_length"):
        raise InvalidArgumentError(f"compare() takes another generation, got {type(b).__name__}")
    if a.prompt_length != b.prompt_length:
        raise InvalidArgumentError(f"the prompts differ in length ({a.prompt_length} vs {b.prompt_length}), so "
                                   "positions and steps do not line up", remedy="Compare generations of one prompt "
                                   "length (pad the shorter prompt).")
    diffs, first = [], None
    for sa, sb in zip(a.steps, b.steps):
        la, lb = sa.logits, sb.logits
        if la is None or lb is None or la.shape != lb.shape:
            diffs.append(float("inf"))
        else:
            diffs.append(float((la.double() - lb.double()).abs().max()))
            if first is None and not torch.allclose(la, lb, atol=atol, rtol=rtol):
                first = sa.index
        if first is None and diffs[-1] == float("inf"):
            first = sa.index
    step = None if first is None else compare(a.steps[first].trace, b.steps[first].trace, atol=atol, rtol=rtol)
    position = first_token_difference(a.sequences, b.sequences, a.prompt_length)
    tokens = None
    if position is not None:
        tokens = tuple(seq[:, position].tolist() if seq.shape[1] > position else []
                       for seq in (a.sequences, b.sequences))
    return GenerationComparison(diffs, first, step, position,
                                None if position is None else position - a.prompt_length, tokens)


def first_token_difference(a: torch.Tensor | None, b: torch.Tensor | None, prompt_length: int) -> int | None:
    """The first position (after the prompt) whose token differs in any row; a length change counts."""
    if a is None or b is None:
        return None
    n = min(a.shape[1], b.shape[1])
    differs = (a[:, :n] != b[:, :n]).any(dim=0).nonzero()
    if len(differs):
        return max(int(differs[0]), prompt_length)
    return None if a.shape[1] == b.shape[1] else n
