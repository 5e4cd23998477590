"""``gen.fork().do(tl.at_step(site, k), edit)``: a generation edited after the fact, replayed.

The steps before the first step the edit reaches are unchanged, so the fork shares them with its
parent. Step ``k`` runs with the edit: Hugging Face ``generate`` resumes from a copy of the parent's
KV cache cut back to what step ``k`` received (the prompt is not read again), with the random
number generator as it was at step ``k``. The steps after it are replayed from the parent's records
(``generation.replay``: the blocks below the edited one are read, not run) while each step's token
is the parent's, and regenerated for real from the first token that differs. Where replay cannot
apply (a decoding loop, no KV cache, a cache that cannot be cut back) the fork re-executes every
step from ``k`` (or from the prompt) and says why. ``fork.record`` says which steps were reused,
replayed, edited and regenerated, and where the text first diverged from the parent's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StepNotFoundError
from ._steps import cache_at, cache_of, record_steps
from .compare import first_token_difference
from .replay import ReplayingCapture, ReplayPlan, plan_replay
from .sites import StepSet, check_reached

if TYPE_CHECKING:
    from .trace import GenerationTrace

__all__ = ["ForkRecord", "rerun"]

# generate options counted from the start of the call: resuming mid-way would change what they mean
# (the first new token; the penalty's start index is the prompt's length)
_RELATIVE = ("min_new_tokens", "begin_suppress_tokens", "exponential_decay_length_penalty")
# generate keywords that can end a row of a batch on a condition the fork cannot read back from the tokens
_ROW_STOPS = ("stopping_criteria", "stop_strings")
# per-step fields of a generate output (one entry per step): a resumed generate holds only its own steps
_PER_STEP = ("scores", "logits", "attentions", "hidden_states")


@dataclass
class ForkRecord:
    """What a fork's last ``do`` computed, how, and where its text left the parent's.

    Every step from ``first`` on is in exactly one of ``replayed`` (computed from the parent's
    records: blocks from the edited one on, the rest read), ``edited`` (an edit applies there and
    every token so far is the parent's: captured for real) and ``regenerated`` (the model ran again
    for real: from the first step whose token differs, or every step when replay could not apply).
    """

    first: int  # the first step the edit reaches: steps before it are the parent's
    reused: list[int]  # steps shared with the parent (not re-run)
    regenerated: list[int]  # steps the model ran again, for real
    how: str  # "replayed from step k ...", "resumed at step k from the parent's KV cache: <why>", "regenerated ..."
    diverged_at: int | None  # the first absolute position whose token differs from the parent's (None: same text)
    diverged_step: int | None  # the step that chose that token
    replayed: list[int] = field(default_factory=list)  # steps computed from the parent's records
    edited: list[int] = field(default_factory=list)  # steps captured for real because an edit applies there
    layers: str = ""  # which blocks the replayed steps ran, and which they read from the parent
    fallback: str | None = None  # why the fork re-executed instead of replaying (None: it replayed)


def rerun(gen: GenerationTrace, triple: tuple[Any, StepSet, Any]) -> tuple[list[Any], Any, ForkRecord]:
    """Recompute ``gen``'s generation with its edits and ``triple`` from the first step ``triple`` reaches:
    replayed from ``gen``'s records while the tokens stay the parent's, else re-executed.

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
    if first == 0 and gen.run.loop is None:
        resume, why = (gen.run.inputs, dict(gen.run.kwargs)), ""
    else:
        resume, why = _resume_at(gen, first)
    plan, fallback = plan_replay(gen, triple[0], first) if resume is not None else (None, why)
    if plan is None and first == 0:
        resume, why = None, fallback
    kinds: dict[int, str] = {}
    rng = gen.run.start_rng if resume is None or first == 0 else gen.records[first].rng_state
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng)
        if resume is None:
            records, output = record_steps(gen.model, gen.run, edits)
        else:
            inputs, kwargs = resume
            capture = None if plan is None else _replaying(plan, kinds)
            records, output = record_steps(gen.model, gen.run, edits, inputs=inputs, kwargs=kwargs, first=first,
                                           capture=capture)
            records = [*gen.records[:first], *records]
            output = _with_parent_steps(gen, output, first) if first > 0 else output
    check_reached([triple], len(records))
    seq = getattr(output, "sequences", output)
    position = first_token_difference(gen.sequences, seq if isinstance(seq, torch.Tensor) else None, gen.prompt_length)
    start = 0 if resume is None else first
    steps = range(start, len(records))
    if plan is None:
        how = (f"regenerated from the prompt: {why}" if resume is None else
               f"resumed at step {first} from the parent's KV cache: {fallback}")
        record = ForkRecord(first, list(range(start)), list(steps), how, position,
                            None if position is None else position - gen.prompt_length, fallback=fallback)
    else:
        how = f"replayed from step {first}"
        if plan.diverged is not None:
            how += f"; step {plan.diverged} reads a token the parent did not choose: regenerated from there on"
        record = ForkRecord(first, list(range(start)), [k for k in steps if kinds.get(k) == "regenerated"], how,
                            position, None if position is None else position - gen.prompt_length,
                            replayed=[k for k in steps if kinds.get(k) == "replayed"],
                            edited=[k for k in steps if kinds.get(k) == "edited"], layers=plan.describe())
    return records, output, record


def _replaying(plan: ReplayPlan, kinds: dict[int, str]) -> Any:
    def build(*args: Any, **kwargs: Any) -> ReplayingCapture:
        capture = ReplayingCapture(*args, plan=plan, **kwargs)
        capture.kinds = kinds
        return capture
    return build


def _resume_at(gen: GenerationTrace, k: int) -> tuple[tuple[Any, dict] | None, str]:
    """The inputs and generate keywords that continue ``gen`` at step ``k`` from a cropped
    copy of the cache step ``k`` received; ``(None, why)`` when it must regenerate instead."""
    run = gen.run
    if run.loop is not None:
        return None, "a decoding loop runs from its inputs"
    if k == 0:
        return None, "the edit reaches step 0, the prompt"
    relative = [key for key in _RELATIVE if _decoding_option(gen, key)]
    if relative:
        return None, f"{relative} count from the start of generate"
    step = gen.records[k]
    key, cache = cache_of(step.kwargs)
    stopped = _stopped_rows(gen, k)
    if stopped:
        return None, stopped
    if cache is None or step.start is None or step.length is None:
        return None, "the step received no KV cache to resume from"
    if not getattr(cache, "is_croppable", False) or not hasattr(cache, "crop"):
        return None, f"a {type(cache).__name__} cannot be cropped back to step {k}"
    cache = cache_at(cache, step.start)  # a copy: the parent's steps keep theirs
    end = step.start + step.length  # the tokens known when step k ran: the prompt and k - 1 new ones
    inputs = dict(run.inputs) if isinstance(run.inputs, dict) else {"input_ids": run.inputs}
    # generate expanded each prompt row into its num_return_sequences rows (repeat_interleave): the
    # sequences and the cache hold the expanded rows, so the other inputs are expanded alike, once
    rows = gen.sequences.shape[0]
    inputs = {name: _expanded(v, rows) for name, v in inputs.items()}
    inputs["input_ids"] = gen.sequences[:, :end]
    # generate reads only the tokens the cache lacks when the mask covers every token given
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        mask = torch.ones(inputs["input_ids"].shape[0], gen.prompt_length, dtype=torch.long,
                          device=inputs["input_ids"].device)
    inputs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], end - mask.shape[1])], dim=1)
    kwargs = {name: v for name, v in run.kwargs.items() if name not in ("cache_implementation", "num_return_sequences")}
    new = _decoding_option(gen, "max_new_tokens")  # given, or set in a generation config
    if isinstance(new, int):
        kwargs["max_new_tokens"] = new - (end - gen.prompt_length)
    kwargs[key] = cache
    return (inputs, kwargs), ""


def _stopped_rows(gen: GenerationTrace, k: int) -> str:
    """Why resuming ``generate`` at step ``k`` would decode a batch row that already ended ("" if none did).

    ``generate`` starts every row unfinished: a row that chose an end-of-sequence token before step
    ``k`` (and was padded since) would be decoded again from its pad token.
    """
    rows = gen.sequences.shape[0] if gen.sequences is not None else 1
    if rows < 2:
        return ""  # a lone row that ended ended the generation: there is no step after it
    given = [key for key in _ROW_STOPS if gen.run.kwargs.get(key) is not None]
    if given:
        return f"{given} may have ended a row of the batch before step {k}, which resuming would decode again"
    eos = _eos_ids(gen)
    chosen = gen.sequences[:, gen.prompt_length:gen.prompt_length + k]  # the tokens steps 0..k-1 chose
    ended = [row for row in range(rows) if any(int(t) in eos for t in chosen[row])]
    if ended:
        return (f"batch row(s) {ended} chose an end-of-sequence token before step {k}; resuming generate "
                "would decode them again")
    return ""


def _eos_ids(gen: GenerationTrace) -> set[int]:
    """The end-of-sequence token ids the generation stopped rows on (``eos_token_id=``, else its config's)."""
    eos = _decoding_option(gen, "eos_token_id")
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        return {int(t) for t in eos.flatten().tolist()}
    return {int(t) for t in eos} if isinstance(eos, (list, tuple, set)) else {int(eos)}


def _decoding_option(gen: GenerationTrace, name: str) -> Any:
    """A ``generate`` option as the generation used it: the keyword, else the ``generation_config=``
    given, else the model's own ``generation_config`` (None: set nowhere)."""
    if name in gen.run.kwargs:
        return gen.run.kwargs[name]
    config = gen.run.kwargs.get("generation_config") or getattr(gen.model, "generation_config", None)
    return getattr(config, name, None)


def _with_parent_steps(gen: GenerationTrace, output: Any, first: int) -> Any:
    """A resumed ``generate``'s output with the parent's per-step fields of steps ``0..first-1`` in front,
    so ``fork.output.scores`` (and logits, attentions, hidden states) has one entry per step, as generate's."""
    for name in _PER_STEP:
        mine, theirs = getattr(output, name, None), getattr(gen.output, name, None)
        if isinstance(mine, tuple) and isinstance(theirs, tuple) and len(theirs) >= first:
            setattr(output, name, (*theirs[:first], *mine))
    return output


def _expanded(value: Any, rows: int) -> Any:
    """A per-row input tensor repeated row by row to ``rows`` rows, as ``generate`` expands its inputs."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] in (0, rows) \
            or rows % value.shape[0]:
        return value
    return value.repeat_interleave(rows // value.shape[0], dim=0)


def _first_step(steps: StepSet) -> int:
    if steps.items is not None:
        return min(steps.items)
    return steps.start
