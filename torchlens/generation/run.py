"""``tl.generate``: run the model's real generation (or your decoding loop), one trace per step."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..api import check_model
from ..core.selectors import Selector
from ..core.steps import Step
from ..core.text import is_text, text_inputs, tokenizer_for
from ..errors import (
    EmptyGenerationError,
    GenerationStrategyError,
    InvalidArgumentError,
    NoGenerateError,
)
from ._steps import GenerationRun, record_steps
from .sites import StepKeep, StepSet, check_outside_encoder, check_reached, edit_triple
from .trace import GenerationTrace

__all__ = ["generate"]

_SUPPORTED = ("greedy_search", "sample")  # Hugging Face generation modes whose steps are one call each


def generate(model: nn.Module, inputs: Any, *, loop: Callable[[nn.Module, Any], Any] | None = None,
             intervene: Any = None, save: Any = None, tokenizer: Any = None, seed: int | None = None,
             backend: str | None = None, **generate_kwargs: Any) -> GenerationTrace:
    """Generate with the model's real ``generate`` (or ``loop``), recording each forward call as a step.

    Step ``k`` is the ``k``-th call of the model's forward: with a KV cache, step 0 reads the
    prompt and step ``k > 0`` the token chosen at step ``k - 1``. Each step is captured like
    ``tl.trace`` (every op, or the ``save=`` sites' values only); the model returns what it
    would have returned (with the step's edits), so the tokens equal a plain ``generate`` with
    the same arguments and the same edits applied by forward hooks counting calls.

    Args:
        model: an eager ``nn.Module``; left exactly as it was, also if generation raises or is interrupted.
        inputs: token ids (a tensor), a dict of keyword inputs (``{"input_ids": ..., "attention_mask": ...}``,
            or a tokenizer's ``BatchEncoding``), or text (a string or list of strings) with ``tokenizer=``.
        loop: your decoding loop instead of ``model.generate``: ``loop(model, inputs)`` calls
            ``model(...)`` once per step (each call is a step) and returns the token ids
            ``(batch, prompt + new)``.
        intervene: edits applied while generating: ``(site, edit)`` pairs or ``tl.when(site, edit)``,
            one or a list. A plain site is edited at every step; ``tl.at_step(site, k | range | list)``
            at those steps only (a steering vector at every new token: ``tl.at_step(site, slice(1, None))``).
        save: keep only the values of these sites (as ``tl.trace(save=...)``): a plain site at every
            step, ``tl.at_step(site, k | range | list)`` at those steps only (the other steps keep no
            value of it); the graph of each step is still recorded. None keeps every value.
        tokenizer: a Hugging Face tokenizer: encodes text ``inputs`` and decodes ``gen.text``.
        seed: ``torch.manual_seed(seed)`` before generating (sampling then equals a plain
            ``generate`` after the same ``manual_seed``); the global RNG state is restored afterwards.
        backend: the capture engine of each step (default: the cheapest that serves the request).
        **generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``do_sample``,
            ``cache_implementation="static"`` ...). Compilation is turned off (``disable_compile``).

    Returns:
        a :class:`~torchlens.generation.trace.GenerationTrace`.

    Raises:
        NoGenerateError: the model has no ``generate`` and no ``loop`` was given.
        GenerationStrategyError: beam search or another strategy that is not greedy or sampling, or
            classifier-free guidance (``guidance_scale``), which calls the model twice per token.
        EmptyGenerationError: ``max_new_tokens`` is 0, or the loop never called the model.
        StepNotFoundError: an edit names a step beyond the steps the generation ran.
        SiteNotInStepError: an edit or ``save=`` site is in an encoder-decoder model's encoder, which
            ``generate`` runs once before step 0 (the remedy runs it with ``tl.trace`` and passes
            ``encoder_outputs``).
        StepEditShapeError: an edit does not fit the activation at some step (named with its shape).
        UnsupportedModelError: the model is not an eager ``nn.Module``.
    """
    model = check_model(model)
    edits = _edits(intervene)
    if loop is None:
        _check_generate(model, generate_kwargs)
        _check_reach(edits, generate_kwargs.get("max_new_tokens"))
    elif not callable(loop):
        raise InvalidArgumentError(f"loop= takes a function loop(model, inputs), got {type(loop).__name__}")
    elif generate_kwargs:
        raise InvalidArgumentError(f"{sorted(generate_kwargs)} are keywords of model.generate; with loop= your "
                                   "loop decides how to decode", remedy="Pass them to your loop instead.")
    keep = StepKeep(save)
    if loop is None:
        _check_reach(keep.triples(), generate_kwargs.get("max_new_tokens"))
        saved = [] if save is None else list(save) if isinstance(save, (list, tuple)) else [save]
        check_outside_encoder(model, [inner for inner, _, _ in edits] + saved)
    tokenizer = tokenizer_for(model, tokenizer)
    inputs = _encode(model, inputs, tokenizer)
    prompt_length = _prompt_length(inputs)
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        run = GenerationRun(inputs, loop, dict(generate_kwargs), save, backend, tokenizer, torch.get_rng_state())
        records, output = record_steps(model, run, edits)
    check_reached([*edits, *keep.triples()], len(records))
    return GenerationTrace(model, records, output=output, prompt_length=prompt_length, run=run, edits=edits)


def _encode(model: nn.Module, inputs: Any, tokenizer: Any) -> Any:
    """Token ids for ``generate`` from text (the one text rule, ``core.text``); a mapping of keyword
    inputs (a tokenizer's ``BatchEncoding``) as a dict; other inputs as given."""
    if isinstance(inputs, Mapping) and not isinstance(inputs, dict):
        return dict(inputs)
    if not is_text(inputs):
        return inputs
    args, kwargs = text_inputs(inputs, model, tokenizer)
    kwargs.pop("position_ids", None)  # generate counts positions from the attention mask itself
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        kwargs = _left_padded(kwargs)
    return args[0] if args else kwargs


def _left_padded(kwargs: dict) -> dict:
    """Text inputs with each row's padding moved to its left: a decoder-only model continues a row
    from its last position, which right padding (a tokenizer's ``padding_side="right"``) fills with pads."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool((mask[:, -1] == 0).any()):
        return kwargs
    order = torch.argsort(mask, dim=1, stable=True)  # each row: its pads first, then its tokens, in order
    return {name: value.gather(1, order) if isinstance(value, torch.Tensor) and value.shape == mask.shape else value
            for name, value in kwargs.items()}


def _prompt_length(inputs: Any) -> int:
    ids = inputs.get("input_ids", inputs.get("inputs_embeds")) if isinstance(inputs, dict) else inputs
    if isinstance(ids, tuple) and ids:
        ids = ids[0]
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return int(ids.shape[1])
    raise InvalidArgumentError(
        f"the prompt's length is read from token ids (batch, sequence); got {type(ids).__name__}",
        remedy="Pass token ids as a tensor or {'input_ids': ids, ...} (or text with tokenizer=).")


def _edits(intervene: Any) -> list[tuple[Selector, StepSet, Any]]:
    """``(inner site, steps, edit)`` per edit given to ``intervene=``."""
    if intervene is None:
        return []
    items = [intervene] if isinstance(intervene, Step) or _is_pair(intervene) else intervene
    if not isinstance(items, (list, tuple)):
        raise InvalidArgumentError(f"intervene= takes (site, edit) pairs or tl.when(site, edit), one or a list; "
                                   f"got {type(intervene).__name__}")
    out = []
    for item in items:
        if isinstance(item, Step):
            out.append(edit_triple(item.site, item.edit))
        elif _is_pair(item):
            out.append(edit_triple(*item))
        else:
            raise InvalidArgumentError(f"intervene= takes (site, edit) pairs or tl.when(site, edit); got "
                                       f"{type(item).__name__} {item!r:.60}")
    return out


def _is_pair(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (str, Selector))


def _check_generate(model: nn.Module, kwargs: dict) -> None:
    """Refuse a model without ``generate``, a strategy other than greedy or sampling, and no new token."""
    if not callable(getattr(model, "generate", None)):
        raise NoGenerateError(f"{type(model).__name__} has no generate method to run")
    new = kwargs.get("max_new_tokens")
    if isinstance(new, numbers.Integral) and new <= 0:
        raise EmptyGenerationError(f"max_new_tokens={new}: the generation would choose no token, so it has no step "
                                   "after the prompt to read or edit", max_new_tokens=new)
    config = getattr(model, "generation_config", None)
    given = kwargs.get("generation_config")
    if given is not None or config is not None:
        config = copy.deepcopy(given if given is not None else config)
        config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        name = str(getattr(mode, "value", mode))
        if name not in _SUPPORTED:
            raise GenerationStrategyError(
                f"tl.generate runs greedy decoding and sampling, one beam, one model call per step; this "
                f"generation is {name} (num_beams={config.num_beams})", mode=name)
        scale = getattr(config, "guidance_scale", None)
        if scale is not None and scale != 1 and not getattr(model.config, "is_encoder_decoder", False):
            # the guidance processor runs the model again on the unconditional rows inside each step
            raise GenerationStrategyError(
                f"tl.generate runs one model call per step; classifier-free guidance (guidance_scale={scale}) "
                "calls the model twice per new token (the second, unconditional call inside a logits "
                "processor), so a step would not be one token", mode="classifier_free_guidance")


def _check_reach(edits: list[tuple[Selector, StepSet, Any]], max_new_tokens: Any) -> None:
    """Before generating: an edit's step beyond ``max_new_tokens`` steps can never be reached."""
    if isinstance(max_new_tokens, numbers.Integral) and max_new_tokens > 0:
        check_reached(edits, int(max_new_tokens), before=True)
