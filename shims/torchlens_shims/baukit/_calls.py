"""Calling a user's edit function with only the arguments it declares (baukit's rules).

baukit lets ``edit_output`` be written as ``f(output)``, ``f(output, layer)``,
``f(layer, output)`` or ``f(output, layer, inputs)``: the caller offers everything by
name and the callee takes what it names, the rest being filled in by position. Ported
code depends on those exact rules, so they are reproduced here:

1. a positional parameter whose name the caller offers gets that value;
2. other positional parameters take the caller's positional values in order;
3. parameters still empty take the caller's not-yet-used keyword values, in the
   caller's order (values reserved for keyword-only parameters are skipped);
4. a required parameter that is still empty is an error; an optional one keeps its
   default;
5. leftover keyword values are passed on only to keyword-only parameters of those
   names, or to every name when the function has ``*args`` (baukit's condition, kept
   as is so that ported code behaves identically);
6. leftover positional values are passed on only if the function has ``*args``.

Deviation: the signature is read as Python will call the object, so a bound method or
a callable object does not count its own ``self`` (baukit's use of ``getfullargspec``
counts it and then fails with a TypeError).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torchlens.errors import InvalidArgumentError

__all__ = ["invoke_with_optional_args"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _describe(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    # follow_wrapped=False: a decorator's own (*args, **kwargs) signature is what baukit
    # sees too, so decorated edits receive the same arguments they did under baukit.
    try:
        return inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"cannot read the parameters of {_describe(fn)} to pass it (output, layer, inputs): {exc}",
            remedy="Wrap it in a Python function, e.g. lambda output, layer: fn(output).",
            callable=fn,
        ) from None


def invoke_with_optional_args(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with just the offered arguments it declares; see the module docstring."""
    params = list(_signature(fn).parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    keyword_only = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    has_star_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)

    call_args: list[Any] = []
    used_names: set[str] = set()
    empty_slots: list[int] = []
    next_positional = 0
    for param in positional:
        if param.name in kwargs:
            call_args.append(kwargs[param.name])
            used_names.add(param.name)
        elif next_positional < len(args):
            call_args.append(args[next_positional])
            next_positional += 1
        else:
            empty_slots.append(len(call_args))
            call_args.append(None if param.default is inspect.Parameter.empty else param.default)

    spare = [k for k in kwargs if k not in used_names and k not in keyword_only]
    while empty_slots and spare:
        name = spare.pop(0)
        call_args[empty_slots.pop(0)] = kwargs[name]
        used_names.add(name)
    missing = [positional[i].name for i in empty_slots if positional[i].default is inspect.Parameter.empty]
    if missing:
        raise InvalidArgumentError(
            f"{_describe(fn)}() cannot be passed {', '.join(missing)}: only "
            f"{', '.join(kwargs) or 'nothing'} can be offered to it",
            remedy="Give the extra parameters defaults, or bind them with functools.partial.",
            callable=fn,
            missing=missing,
        )

    pass_kwargs = {
        k: v for k, v in kwargs.items() if k not in used_names and (k in keyword_only or has_star_args)
    }
    if has_star_args:
        call_args.extend(args[next_positional:])
    return fn(*call_args, **pass_kwargs)
