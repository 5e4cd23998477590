"""From what an invoke is given (text, token ids, an encoding) to one forward's inputs.

Each invoke contributes rows: a string is one row, a list of strings one per
string, token ids one per sequence. `batch_forward` tokenizes each invoke's rows
on their own and pads them together on the side the tokenizer pads (left for a
causal LM, so ``[:, -1]`` is every row's real last token), then gives left-padded
rows mask-derived ``position_ids`` so an absolute-position model sees each token
at its own position — the same assembly nnsight 0.8 makes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch._guards import detect_fake_mode
from transformers import GenerationConfig

from .errors import BatchingNotSupportedError, InputFieldError

__all__ = [
    "ROW_FIELDS",
    "SHARED_FIELDS",
    "TARGET_FIELDS",
    "TOKENIZER_KWARGS",
    "as_encoding",
    "batch_forward",
    "batch_pipe",
    "batch_size",
    "collate",
    "conversations",
    "encode_pretokenized",
    "input_key",
    "is_token_ids",
    "positions",
    "preprocess_invoke",
    "rows_with_fields",
    "split",
    "supply_position_ids",
]

# Per-row model inputs, and what a narrower row is padded with (None: pad token).
ROW_FIELDS: dict[str, Any] = {
    "input_ids": None,
    "inputs_embeds": 0.0,
    "attention_mask": 0,
    "token_type_ids": 0,
    "position_ids": 0,
    "special_tokens_mask": 1,
    "labels": -100,
    "decoder_input_ids": None,
    "decoder_attention_mask": 0,
    "decoder_inputs_embeds": 0.0,
}
# any other per-token field (``global_attention_mask`` ...) pads with this
OTHER_PAD = 0
TARGET_FIELDS = frozenset({"decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds"})
SHARED_FIELDS = frozenset({"token_type_ids", "position_ids"})
TOKENIZER_KWARGS = frozenset({"add_special_tokens", "truncation", "padding", "tokenizer_encode_kwargs"})


def is_token_ids(data: Any) -> bool:
    leaf = data
    while isinstance(leaf, (list, tuple)) and leaf:
        leaf = leaf[0]
    if leaf is not data and isinstance(leaf, numbers.Integral):
        return True
    if isinstance(leaf, torch.Tensor) or type(leaf).__module__ == "numpy":
        return not torch.as_tensor(leaf).is_floating_point()
    return False


def input_key(encoding: Mapping) -> str | None:
    for key in ("input_ids", "inputs_embeds"):
        if encoding.get(key) is not None:
            return key
    return None


def as_encoding(data: Any, kwargs: dict) -> dict | None:
    """An invoke written as model inputs, merged into one dict; ``None`` for text."""
    if is_token_ids(data):
        return {"input_ids": data, **kwargs}
    mapping = kwargs if data is None else data
    if not isinstance(mapping, Mapping):
        return None
    values = list(mapping.values())
    if values and not any(isinstance(v, torch.Tensor) for v in values) and input_key(mapping) is None:
        return None
    return {**(dict(data) if data is not None else {}), **kwargs}


def split(key: str, value: Any, batched: bool | None = None, width: int | None = None) -> tuple[list, bool]:
    """One field -> its rows (each with a leading dim of 1) and whether it came batched."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], numbers.Number):
        return [row for entry in value for row in split(key, entry)[0]], True
    value = torch.as_tensor(value)
    row_dims = 2 if key.endswith("inputs_embeds") else 1
    if batched is None:
        batched = value.dim() > row_dims
    if value.dim() > 0 and (batched or value.dim() > row_dims):
        return list(value.unsqueeze(1)), batched
    if value.numel() == 1 and width not in (None, 1):
        return [value.reshape(1)], batched
    return [value.unsqueeze(0)], batched


def _is_conversation(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and all(
        isinstance(message, Mapping) and "role" in message for message in data
    )


def conversations(data: Any) -> list | None:
    """Chat input as a list of conversations (one message list, or a list of them); else ``None``."""
    if _is_conversation(data):
        return [data]
    if isinstance(data, (list, tuple)) and data and all(_is_conversation(item) for item in data):
        return list(data)
    return None


def batch_size(inputs: tuple, kwargs: dict) -> int:
    data = inputs[0] if inputs else None
    chats = conversations(data)
    if chats is not None:
        return len(chats)  # a conversation is one row, not one row per message
    encoding = as_encoding(data, kwargs)
    key = input_key(encoding) if encoding is not None else None
    if key is not None:
        return len(split(key, encoding[key])[0])
    if data is None:
        return int(any(kwargs.get(k) is not None for k in ("text", "images", "pixel_values", "input_features")))
    if isinstance(data, torch.Tensor):
        return 1 if data.ndim <= 1 else data.shape[0]
    if isinstance(data, (list, tuple)):
        return len(data)
    return 1


def encode_pretokenized(encoding: dict) -> tuple[list[dict], dict]:
    fields = {k: v for k, v in encoding.items() if k in ROW_FIELDS and v is not None}
    forward = {k: v for k, v in encoding.items() if k not in ROW_FIELDS}
    source = input_key(fields)
    rows, batched = split(source, fields.pop(source))
    items = [{source: row} for row in rows]
    if "attention_mask" not in fields and encoding.get("past_key_values") is None:
        for item in items:
            row = item[source]
            shape = row.shape if source == "input_ids" else row.shape[:-1]
            item["attention_mask"] = torch.ones(shape, dtype=torch.long)
    width = rows[0].shape[1]
    for key, value in fields.items():
        parts, _ = split(key, value, batched, width)
        if len(parts) == 1 and key in SHARED_FIELDS:
            parts = parts * len(items)  # one segment / position row serves every row
        if len(parts) != len(items):
            raise InputFieldError(f"`{key}` has {len(parts)} rows, but `{source}` has {len(items)}.")
        if key in SHARED_FIELDS and parts[0].shape[-1] != width:
            raise InputFieldError(f"`{key}` has {parts[0].shape[-1]} positions for a row of {width}.")
        for item, part in zip(items, parts):
            item[key] = part
    return items, forward, batched


_GENERATION_OPTIONS = frozenset(vars(GenerationConfig()))


def _is_per_row(key: str, value: Any) -> bool:
    """A field beside the ids that may hold one entry per row (a tensor, or nested lists of numbers)."""
    if key in _GENERATION_OPTIONS or key in TOKENIZER_KWARGS:
        return False  # `bad_words_ids=[[...]]` & co. configure generation, they are no rows
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    leaf = value
    while isinstance(leaf, (list, tuple)) and leaf:
        leaf = leaf[0]
    return leaf is not value and isinstance(leaf, numbers.Number)


def rows_with_fields(encoding: dict) -> tuple[list[dict], dict]:
    """One invoke's rows, carrying its per-example fields outside the table (``start_positions`` ...).

    A field the table does not know is split into the invoke's rows when it has one entry
    per row, so invokes batch it as the model would see it batched; any other value stays
    a forward keyword.
    """
    items, forward, batched = encode_pretokenized(encoding)
    width = items[0][input_key(items[0])].shape[1]
    kept = {}
    for key, value in forward.items():
        parts = split(key, value, batched, width)[0] if _is_per_row(key, value) else []
        if len(parts) != len(items):
            kept[key] = value
            continue
        for item, part in zip(items, parts):
            item[key] = part
    return items, kept


def _has_other_tensors(encoding: Mapping) -> bool:
    return any(k not in ROW_FIELDS and isinstance(v, torch.Tensor) for k, v in encoding.items())


def preprocess_invoke(model: Any, data: Any, kwargs: dict) -> tuple[list[dict] | None, Any]:
    """One invoke -> (rows, forward kwargs), or (None, (args, kwargs)) for a lone passthrough."""
    if isinstance(data, torch.Tensor) and data.is_floating_point():
        return None, ((data,), kwargs)
    encoding = as_encoding(data, kwargs)
    if encoding is not None:
        if input_key(encoding) is None or _has_other_tensors(encoding):
            if input_key(encoding) is not None and not all(
                isinstance(v, torch.Tensor) and v.dim() > 1
                for k, v in encoding.items()
                if k in ROW_FIELDS and v is not None
            ):
                rows, forward, _ = encode_pretokenized(encoding)
                encoding = {**collate(model, rows), **forward}
            return None, ((), encoding)
        return encode_pretokenized(encoding)[:2]
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(
            f"{type(model).__name__} has no tokenizer to turn {type(data).__name__} input into token ids; "
            "pass tokenizer= or give token ids"
        )
    chats = conversations(data)
    if chats is not None:  # the model's chat template, as transformers' pipelines apply it
        forward = {k: v for k, v in kwargs.items() if k not in TOKENIZER_KWARGS}
        rows = []
        for chat in chats:
            ids = torch.tensor([tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)])
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return rows, forward
    # `max_length` beside `truncation` is the tokenizer's cut, not a model or generation option
    words = TOKENIZER_KWARGS | ({"max_length"} if kwargs.get("truncation") else set())
    tokenize = {k: v for k, v in kwargs.items() if k in words and v is not None}
    tokenize.update(tokenize.pop("tokenizer_encode_kwargs", None) or {})
    forward = {k: v for k, v in kwargs.items() if k not in words}
    texts = list(data) if isinstance(data, (list, tuple)) else [data]
    rows = []
    for text in texts:
        encoded = tokenizer(text, return_tensors="pt", **tokenize)
        rows.append({k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)})
    return rows, forward


def positions(mask: torch.Tensor) -> torch.Tensor:
    """``position_ids`` that count a left-padded row from its first real token."""
    mask = mask.long()
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    left_padded = (mask.diff(dim=-1) >= 0).all(-1, keepdim=True)
    return torch.where(left_padded, counted, plain)


def _pad(model: Any, key: str, rows: list[torch.Tensor], left: bool) -> torch.Tensor:
    rows = [row.to(rows[0].device) for row in rows]
    if len({row.shape[1:] for row in rows}) > 1:
        value = ROW_FIELDS.get(key, OTHER_PAD)
        if value is None:
            value = getattr(model.tokenizer, "pad_token_id", None)
            if value is None:
                raise InputFieldError(
                    f"can't pad `{key}` rows of different lengths without a pad token; set "
                    "model.tokenizer.pad_token"
                )
        width = max(row.shape[1] for row in rows)
        after = (0, 0) * (rows[0].dim() - 2)
        rows = [
            torch.nn.functional.pad(
                row,
                after + ((width - row.shape[1], 0) if left else (0, width - row.shape[1])),
                value=value,
            )
            for row in rows
        ]
    return torch.cat(rows)


def collate(model: Any, items: list[dict]) -> dict:
    items = [{k: v for k, v in item.items() if isinstance(v, torch.Tensor)} for item in items]
    if len(items) == 1:
        return items[0]
    keys = list(dict.fromkeys(key for item in items for key in item))
    for item in items:
        for key in keys:
            if key not in item:
                ids = item.get("input_ids", item.get("inputs_embeds"))
                if key == "token_type_ids" and ids is not None:
                    item[key] = torch.zeros(ids.shape[:2], dtype=torch.long)
                elif key == "position_ids" and ids is not None:
                    item[key] = positions(item.get("attention_mask", torch.ones(ids.shape[:2])))
                elif key == "labels" and ids is not None:  # an unlabelled row: ignored by the loss
                    item[key] = torch.full(ids.shape[:2], ROW_FIELDS["labels"], dtype=torch.long)
                else:
                    having = sum(key in other for other in items)
                    raise InputFieldError(
                        f"can't batch these invokes: {having} of {len(items)} rows have `{key}`; pass it "
                        "in every invoke or in none"
                    )
    side = getattr(model.tokenizer, "padding_side", None) or "right"
    encoding = {}
    for key in keys:
        rows = [item[key] for item in items]
        if key in ROW_FIELDS or rows[0].dim() > 1:  # a per-token field: padded to the widest row
            encoding[key] = _pad(model, key, rows, side == "left" and key not in TARGET_FIELDS)
        else:
            encoding[key] = torch.cat(rows)
    return encoding


def supply_position_ids(model: Any, encoding: dict) -> None:
    mask = encoding.get("attention_mask")
    if detect_fake_mode() is not None:
        return
    ids = encoding.get("input_ids", encoding.get("inputs_embeds"))
    if (
        "position_ids" in encoding
        or mask is None
        or ids is None
        or mask.shape != ids.shape[:2]
        or bool(mask.all())
        or getattr(model.tokenizer, "padding_side", None) != "left"
        or any(key not in ROW_FIELDS for key in encoding)
    ):
        return
    position_ids = positions(mask)
    if bool((position_ids == torch.arange(mask.shape[-1], device=mask.device)).all()):
        return
    encoding["position_ids"] = position_ids


def batch_forward(model: Any, invokes: list[tuple[tuple, dict]]) -> tuple[tuple, dict]:
    items: list[dict] = []
    forward: dict = {}
    for inputs, kwargs in invokes:
        data = inputs[0] if inputs else None
        encoding = as_encoding(data, kwargs) if len(invokes) > 1 else None
        if encoding is not None and input_key(encoding) is not None:
            # ids beside per-example fields: each field travels with its rows into the batch
            rows, extra = rows_with_fields(encoding)
        else:
            rows, extra = preprocess_invoke(model, data, kwargs)
            if rows is None:
                if len(invokes) > 1:
                    raise BatchingNotSupportedError("can't batch these inputs; pass text or token ids")
                return extra
        items.extend(rows)
        forward.update(extra)
    encoding = collate(model, items)
    supply_position_ids(model, encoding)
    return (), {**encoding, **forward}


def batch_pipe(invokes: list[tuple[tuple, dict]]) -> tuple[tuple, dict]:
    prompts: list = []
    forward: dict = {}
    for inputs, kwargs in invokes:
        data = inputs[0] if inputs else None
        if isinstance(data, str):
            prompts.append(data)
        elif isinstance(data, (list, tuple)) and data and isinstance(data[0], str):
            prompts.extend(data)
        else:
            if len(invokes) > 1:
                raise BatchingNotSupportedError("only text prompts batch through pipe()")
            return inputs, kwargs
        forward.update(kwargs)
    if len(prompts) == 1:
        return (prompts[0],), forward
    return (prompts,), {**forward, "batch_size": len(prompts)}
