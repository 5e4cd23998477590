"""Text in: the one rule for turning strings into the token ids a model takes, and back.

Every entry point that runs a model (``tl.trace``, ``tl.extract``, ``trace.run``,
``fork.do(..., inputs=)``, ``tl.cache_activations``) tokenizes text here:

- the tokenizer is the one given as ``tokenizer=``, else the model's ``tokenizer``
  attribute (``model.tokenizer = tok`` once, and every call takes text);
- text is tokenized row by row without padding (:func:`encode`), then padded to the
  longest row on the tokenizer's ``padding_side`` (:func:`pad_rows`), with an attention
  mask of 1 on real tokens;
- the model gets ``input_ids``, ``attention_mask`` and the tokenizer's ``token_type_ids``
  as far as its ``forward`` takes them (:func:`feed`); rows padded on the left also get
  ``position_ids`` counted from each row's first real token (as transformers' ``generate``
  and TransformerLens do), so a real token sits at the same position as in its row alone.

Token strings (``trace.str_tokens``) decode each id alone, as TransformerLens's
``to_str_tokens`` does; :func:`token_position` finds a token string in a row.
Documented in docs/concepts.md, "Text in". Tokenizers are duck-typed (a Hugging Face
tokenizer, or any callable returning ``{"input_ids": ...}`` with a ``decode``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import (
    AmbiguousTokenError,
    PaddingNotSupportedError,
    TextError,
    TokenizerRequiredError,
    TokenNotFoundError,
)

__all__ = [
    "HOW_TO_PASS", "decode_tokens", "encode", "feed", "input_ids_of", "is_text", "pad_id", "pad_rows",
    "text_inputs", "token_position", "tokenizer_for",
]

HOW_TO_PASS = ("Pass tokenizer=tok (a Hugging Face tokenizer: AutoTokenizer.from_pretrained(...)), or set it once "
               "on the model: model.tokenizer = tok; or give token ids instead of text.")


def is_text(x: Any) -> bool:
    """Whether ``x`` is text: a string, or a non-empty list of strings (a batch)."""
    return isinstance(x, str) or (isinstance(x, list) and bool(x) and all(isinstance(s, str) for s in x))


def tokenizer_for(model: Any, tokenizer: Any = None) -> Any:
    """The tokenizer a call uses: ``tokenizer=`` when given, else ``model.tokenizer`` (None: none known)."""
    if tokenizer is not None:
        return tokenizer
    found = getattr(model, "tokenizer", None) if model is not None else None
    return found if callable(found) else None


def encode(texts: Sequence[str], tokenizer: Any, *, max_length: int | None = None,
           add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
    """Each text's token ids, unpadded (the one tokenization rule): ``{"input_ids": rows}``, plus
    ``"token_type_ids"`` when the tokenizer returns them. ``max_length`` truncates."""
    kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
    if max_length is not None:
        kwargs.update(truncation=True, max_length=max_length)
    encoded = tokenizer(list(texts), **kwargs)
    if not hasattr(encoded, "keys"):
        return {"input_ids": [list(map(int, r)) for r in encoded]}
    out = {"input_ids": [list(map(int, r)) for r in encoded["input_ids"]]}
    if "token_type_ids" in encoded:
        out["token_type_ids"] = [list(map(int, r)) for r in encoded["token_type_ids"]]
    return out


def pad_id(tokenizer: Any) -> int:
    """The id padding is filled with: the tokenizer's pad token, else its end-of-text token, else 0
    (padding is masked, so its id never reaches a real position)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def pad_rows(rows: Sequence[Sequence[int]], value: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids padded with ``value`` to the longest, on ``side``: ``(ids [B, T], mask [B, T])``,
    the mask 1 on real tokens and 0 on padding."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(list(row), dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def feed(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, what: str = "the rows",
         token_type_ids: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that pass token ids to ``model.forward``: ``input_ids`` (or its first
    parameter), the mask and ``token_type_ids`` as far as it takes them, and ``position_ids``
    counted from each row's first real token when a row is padded on the left.

    Raises:
        PaddingNotSupportedError: ``what`` has rows of different lengths and the forward takes no
            ``attention_mask`` to hide the padding.
    """
    params = _parameters(model)
    any_kw = params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = params or {}
    ragged = not bool(attention_mask.all())
    if "attention_mask" not in named and not any_kw:
        if ragged:
            raise PaddingNotSupportedError(
                f"{what} have different lengths, and {type(model).__name__}.forward takes no attention_mask "
                f"to hide the padding")
        if "input_ids" not in named and named:
            return (input_ids,), {}
        return (), {"input_ids": input_ids}
    kwargs = {"input_ids": input_ids}  # in a Hugging Face tokenizer's order
    if token_type_ids is not None and ("token_type_ids" in named or any_kw):
        kwargs["token_type_ids"] = token_type_ids
    kwargs["attention_mask"] = attention_mask
    if ragged and "position_ids" in named and not bool(attention_mask[:, 0].all()):
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return (), kwargs


def _parameters(model: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return None


def text_inputs(text: str | list[str], model: Any, tokenizer: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model`` from a string or a list of strings.

    Raises:
        TokenizerRequiredError: no tokenizer is given or known from the model.
        PaddingNotSupportedError: strings of different lengths for a forward without ``attention_mask``.
        TextError: a string has no tokens.
    """
    tok = tokenizer_for(model, tokenizer)
    if tok is None:
        shown = text if isinstance(text, str) else text[0]
        raise TokenizerRequiredError(f"the input is text ({shown[:40]!r}) and no tokenizer is known to turn it "
                                     f"into token ids", remedy=HOW_TO_PASS)
    texts = [text] if isinstance(text, str) else list(text)
    columns = encode(texts, tok)
    empty = next((i for i, row in enumerate(columns["input_ids"]) if not row), None)
    if empty is not None:
        raise TextError(f"string {empty} ({texts[empty]!r}) has no tokens", remedy="Drop empty strings from the input.")
    side = getattr(tok, "padding_side", "right")
    side = side if side in ("left", "right") else "right"
    ids, mask = pad_rows(columns["input_ids"], pad_id(tok), side)
    types = columns.get("token_type_ids")
    token_types = None if types is None else pad_rows(types, 0, side)[0]
    return feed(model, ids, mask, what="the strings", token_type_ids=token_types)


def input_ids_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The token ids among a call's inputs: ``input_ids=``, else the first positional integer tensor."""
    value = kwargs.get("input_ids")
    if value is None:
        value = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if isinstance(value, torch.Tensor) and not value.dtype.is_floating_point and not value.dtype.is_complex \
            and value.dtype != torch.bool:
        return value
    return None


def decode_tokens(ids: torch.Tensor, tokenizer: Any) -> list[list[str]]:
    """Each row's token strings, every id decoded alone (as TransformerLens's ``to_str_tokens``)."""
    rows = ids.reshape(1, -1) if ids.dim() < 2 else ids.reshape(-1, ids.shape[-1])
    return [[tokenizer.decode([int(i)], clean_up_tokenization_spaces=False) for i in row] for row in rows.tolist()]


def token_position(str_tokens: Sequence[str], token: str) -> int:
    """The position of ``token`` (a token string such as ``" Paris"``) in a row of token strings.

    Raises:
        TokenNotFoundError: no token of the row is exactly ``token`` (the row's tokens are listed).
        AmbiguousTokenError: ``token`` occurs more than once (every position is named).
    """
    found = [i for i, s in enumerate(str_tokens) if s == token]
    if len(found) == 1:
        return found[0]
    if found:
        raise AmbiguousTokenError(f"the token {token!r} occurs {len(found)} times in the prompt, at positions "
                                  f"{found}", token=token, positions=found,
                                  remedy=f"Give the position as an int: one of {found}.")
    near = [(i, s) for i, s in enumerate(str_tokens) if s.strip() == token.strip() and token.strip()]
    hint = f"; tokens equal to it but for spaces: {near}" if near else ""
    raise TokenNotFoundError(f"{token!r} is not a token of the prompt{hint}; its tokens are {list(str_tokens)}",
                             token=token, str_tokens=list(str_tokens),
                             remedy="Give one of the listed token strings exactly (leading spaces count), "
                                    "or the position as an int.")
