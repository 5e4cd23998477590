"""``gen.fork().do(tl.at_step(site, k), edit)``: a generation edited after the fact, by re-execution.

The steps before the first step the edit reaches are unchanged, so the fork shares them with
its parent. From that step on the model runs again for real: Hugging Face ``generate`` resumes
from a copy of the parent's KV cache cropped to what step ``k`` received (the prompt is not
re-read), with the random number generator as it was at step ``k`` (a sampled token is redrawn
from the same state). A decoding loop, a cache that cannot be cropped, or an edit that reaches
step 0 regenerates from the prompt. ``fork.record`` says which steps were reused and which
re-run, how, and where the text first diverged from the parent's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StepNotFoundError
from ._steps import cache_of, record_steps
from .compare import first_token_difference
from .sites import StepSet, check_reached

if TYPE_CHECKING:
    from .trace import GenerationTrace

__all__ = ["ForkRecord", "rerun"]

# generate keywords counted from the start of the call: resuming mid-way would change what they mean
_RELATIVE = ("min_new_tokens",)


@dataclass
class ForkRecord:
    """What a fork's last ``do`` re-executed, and where its text left the parent's."""

    first: int  # the first step the edit reaches: steps before it are the parent's
    reused: list[int]  # steps shared with the parent (not re-run)
    regenerated: list[int]  # steps the model ran again
    how: str  # "resumed at step k from the parent's KV cache" or "regenerated from the prompt: <why>"
    diverged_at: int | None  # the first absolute position whose token differs from the parent's (None: same text)
    diverged_step: int | None  # the step that chose that token


def rerun(gen: GenerationTrace, triple: tuple[Any, StepSet, Any]) -> tuple[list[Any], Any, ForkRecord]:
    """Re-run ``gen``'s generation with its edits and ``triple`` from the first step ``triple`` reaches.

    Returns:
        the step records (``gen``'s own before that step), what the decoding returned, and the record.

    Raises:
        StepNotFoundError: the edit's first step is beyond ``gen``'s steps.
    """
    first = _first_step(triple[1])
    n = len(gen.steps)
    if first >= n:
        raise StepNotFoundError(f"the edit starts at step {first}, beyond this generation's {n} step(s) "
                                f"(0..{n - 1})", step=first, n_steps=n)
    edits = [*gen.edits, triple]
    resume, why = _resume_at(gen, first)
    if resume is None:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(gen.run.start_rng)
            records, output = record_steps(gen.model, gen.run, edits)
        start, how = 0, f"regenerated from the prompt: {why}"
    else:
        inputs, kwargs = resume
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(gen.records[first].rng_state)
            records, output = record_steps(gen.model, gen.run, edits, inputs=inputs, kwargs=kwargs, first=first)
        records = [*gen.records[:first], *records]
        start, how = first, f"resumed at step {first} from the parent's KV cache"
    check_reached([triple], len(records))
    seq = getattr(output, "sequences", output)
    position = first_token_difference(gen.sequences, seq if isinstance(seq, torch.Tensor) else None, gen.prompt_length)
    record = ForkRecord(first, list(range(start)), list(range(start, len(records))), how, position,
                        None if position is None else position - gen.prompt_length)
    return records, output, record


def _resume_at(gen: GenerationTrace, k: int) -> tuple[tuple[Any, dict] | None, str]:
    """The inputs and generate keywords that continue ``gen`` at step ``k`` from a cropped
    copy of the cache step ``k`` received; ``(None, why)`` when it must regenerate instead."""
    run = gen.run
    if run.loop is not None:
        return None, "a decoding loop runs from its inputs"
    if k == 0:
        return None, "the edit reaches step 0, the prompt"
    if any(key in run.kwargs for key in _RELATIVE):
        return None, f"{[key for key in _RELATIVE if key in run.kwargs]} count from the start of generate"
    step = gen.records[k]
    key, cache = cache_of(step.trace.kwargs)
    if cache is None or step.start is None or step.length is None:
        return None, "the step received no KV cache to resume from"
    if not getattr(cache, "is_croppable", False) or not hasattr(cache, "crop"):
        return None, f"a {type(cache).__name__} cannot be cropped back to step {k}"
    cache = copy.deepcopy(cache)  # the parent's steps keep theirs
    extra = cache.get_seq_length() - step.start
    if extra > 0:
        cache.crop(-extra)
    end = step.start + step.length  # the tokens known when step k ran: the prompt and k - 1 new ones
    inputs = dict(run.inputs) if isinstance(run.inputs, dict) else {"input_ids": run.inputs}
    inputs["input_ids"] = gen.sequences[:, :end]
    # generate reads only the tokens the cache lacks when the mask covers every token given
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        mask = torch.ones(inputs["input_ids"].shape[0], gen.prompt_length, dtype=torch.long,
                          device=inputs["input_ids"].device)
    inputs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], end - mask.shape[1])], dim=1)
    kwargs = {name: v for name, v in run.kwargs.items() if name != "cache_implementation"}
    if isinstance(kwargs.get("max_new_tokens"), int):
        kwargs["max_new_tokens"] -= end - gen.prompt_length
    kwargs[key] = cache
    return (inputs, kwargs), ""


def _first_step(steps: StepSet) -> int:
    if steps.items is not None:
        return min(steps.items)
    return steps.start
