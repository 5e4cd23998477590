"""How a capture gets between a module's call and its forward (used by ``hooks.ModuleHooks``).

Torch's own hook entries, written directly (``attach``); a wrapper in a module's instance
``forward`` slot where that keeps the order hooks would run in (``wrap_every``), which spares
torch's hooked call path on every module call; the walk over a model's modules; and
``CallInfo``, what every callback is told about the call.
"""

from __future__ import annotations

import inspect
import operator
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from ._copies import forget_slot, note_slot

__all__ = [
    "ACTIVE_WRAPPERS", "CALLERS", "NO_FORWARD", "SLOT_LOCK", "CallInfo", "PostHook", "PreHook", "attach",
    "global_hooks", "named_modules", "new_tuple", "own_registration", "run_pre", "run_post", "unwrap",
    "wrap_every", "wrappable",
]

PreHook = Callable[["CallInfo", tuple, dict], Any]
PostHook = Callable[["CallInfo", tuple, dict, Any], Any]


class CallInfo(tuple):
    """One call of one module: enough for a callback to know where it is.

    ``address``, ``module`` and ``pass_index`` (1 for the first call of that module). A tuple
    underneath: made per module call, and a tuple is made without running Python code.
    """

    __slots__ = ()

    def __new__(cls, address: str, module: nn.Module, pass_index: int) -> CallInfo:
        return new_tuple(cls, (address, module, pass_index))

    address = property(operator.itemgetter(0), doc="The module's address ('' for the model itself).")
    module = property(operator.itemgetter(1), doc="The module object.")
    pass_index = property(operator.itemgetter(2), doc="Which call of this module since the hooks were attached.")

    def __repr__(self) -> str:
        return f"CallInfo({self.address!r}, pass={self.pass_index})"


new_tuple = tuple.__new__


def run_pre(callbacks: list[PreHook], info: CallInfo, args: tuple, kwargs: dict) -> Any:
    """Run pre callbacks in order, each seeing the inputs the previous one returned."""
    replaced = None
    for fn in callbacks:
        result = fn(info, args, kwargs)
        if result is not None:
            args, kwargs = result
            replaced = result
    return replaced


def run_post(callbacks: list[PostHook], info: CallInfo, args: tuple, kwargs: dict, output: Any) -> Any:
    """Run post callbacks in order, each seeing the output the previous one returned."""
    replaced = None
    for fn in callbacks:
        result = fn(info, args, kwargs, output)
        if result is not None:
            output = result
            replaced = result
    return replaced


def attach(module: nn.Module, hook: Callable[..., Any], *, pre: bool) -> Any:
    """Add ``hook`` (with kwargs) to ``module``'s forward pre- or post-hooks; return what removes it.

    Every module of a model gets two hooks per capture, so ``RemovableHandle`` (two weak
    references per hook) was most of an every-op capture's setup: for modules that use
    ``nn.Module``'s own registration, the entries it would make are made directly (same id
    counter, same order), the kwargs flag first, so a forward in another thread never finds
    the hook without it. A module type that registers hooks its own way goes through its API.
    """
    if own_registration(type(module)):
        if pre:
            return module.register_forward_pre_hook(hook, with_kwargs=True)
        return module.register_forward_hook(hook, with_kwargs=True)
    if pre:
        hooks, flags = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
    else:
        hooks, flags = module._forward_hooks, module._forward_hooks_with_kwargs
    hook_id = RemovableHandle.next_id
    RemovableHandle.next_id += 1
    flags[hook_id] = True
    hooks[hook_id] = hook
    return hooks, flags, hook_id


_REGISTER_PRE = nn.Module.register_forward_pre_hook
_REGISTER_POST = nn.Module.register_forward_hook
_OWN_REGISTRATION: dict[type, bool] = {}


def own_registration(kind: type) -> bool:
    """Whether modules of type ``kind`` register forward hooks their own way (then we go through it)."""
    found = _OWN_REGISTRATION.get(kind)
    if found is None:
        found = _OWN_REGISTRATION[kind] = kind.register_forward_pre_hook is not _REGISTER_PRE or \
            kind.register_forward_hook is not _REGISTER_POST
    return found


def wrap_every(named: dict[str, nn.Module], skip: Any, pre_fn: PreHook, post_fn: PostHook, counts: dict[str, int],
               owner: int, slots: list[tuple[nn.Module, Any, Any]]) -> list[tuple[str, nn.Module]]:
    """Put a wrapper calling ``pre_fn`` / ``post_fn`` around the forward of every module of ``named``
    that is ``wrappable`` (addresses in ``skip`` aside), in its instance slot.

    The wrapper acts only when torch's module call runs it (``module(x)``, as a hook would;
    ``module.forward(x)`` called directly is passed through) in the thread that attached it.

    Each slot wrapped is appended to ``slots`` as it is (for ``unwrap``, also after an interruption).

    Returns:
        The ``(address, module)`` pairs that need hooks instead.
    """
    rest: list[tuple[str, nn.Module]] = []
    active = ACTIVE_WRAPPERS
    plain = _PLAIN_FORWARD
    for address, module in named.items():
        if skip and address in skip:
            continue
        own = module.__dict__
        previous = own.get("forward", NO_FORWARD)
        # ``wrappable``, inlined: this loop runs over every module of the model on every capture
        kind = type(module)
        found = plain.get(kind)
        if found is None:
            found = _plain_forward(kind)
        if not found or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks \
                or module._backward_pre_hooks or id(previous) in active:
            rest.append((address, module))
            continue
        wrapper = _wrapper(module, address, module.forward if previous is NO_FORWARD else previous, pre_fn, post_fn,
                           counts, owner)
        slots.append((module, previous, wrapper))
        own["forward"] = wrapper
        active.add(id(wrapper))
        note_slot(wrapper, previous, NO_FORWARD)  # copies made meanwhile get ``previous`` back
    return rest


def unwrap(slots: list[tuple[nn.Module, Any, Any]]) -> None:
    """Give each slot ``wrap_every`` wrapped back what it held (the latest first);
    a slot the model's own code has replaced since keeps what it put there. Hold ``SLOT_LOCK``."""
    active = ACTIVE_WRAPPERS
    for module, previous, wrapper in reversed(slots):
        own = module.__dict__
        active.discard(id(wrapper))
        forget_slot(wrapper)
        if own.get("forward") is not wrapper:
            continue  # replaced since (by the model's own code): theirs stays
        if previous is NO_FORWARD:
            del own["forward"]
        else:
            own["forward"] = previous


def _wrapper(module: nn.Module, address: str, forward: Any, pre_fn: PreHook, post_fn: PostHook,
             counts: dict[str, int], owner: int) -> Any:
    """The wrapper ``wrap_every`` puts in ``module``'s slot around ``forward``."""

    def forward_wrapper(*args, **kwargs):
        caller = _getframe(1).f_code  # compared by identity: hashing a code object hashes its constants
        if _get_ident() != owner or (caller is not _CALL_IMPL and caller is not _INNER):
            return forward(*args, **kwargs)
        n = counts.get(address, 0) + 1
        counts[address] = n
        info = new_tuple(CallInfo, (address, module, n))
        replaced = pre_fn(info, args, kwargs)
        if replaced is not None:
            args, kwargs = replaced
        output = forward(*args, **kwargs)
        replaced = post_fn(info, args, kwargs, output)
        return output if replaced is None else replaced

    forward_wrapper.__wrapped__ = forward  # inspect.signature(module.forward) still reads the model's
    return forward_wrapper


def wrappable(module: nn.Module) -> bool:
    """Whether ``module`` may be wrapped rather than hooked: no hook of its own (ours then run
    after it), a plain ``forward`` an instance attribute can stand in for."""
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    if id(module.__dict__.get("forward")) in ACTIVE_WRAPPERS:  # another capture's (another thread): hook it
        return False
    kind = type(module)
    found = _PLAIN_FORWARD.get(kind)
    return _plain_forward(kind) if found is None else found


def _plain_forward(kind: type) -> bool:
    """Whether modules of type ``kind`` have a plain ``forward`` a wrapper can stand in for (cached by type)."""
    # a class-level descriptor (a property) would hide the instance attribute; a custom
    # __call__ may not go through torch's call path, where the wrapper acts
    # (a type registering hooks its own way wants to see them)
    found = _PLAIN_FORWARD[kind] = isinstance(inspect.getattr_static(kind, "forward", None), types.FunctionType) \
        and kind.__call__ is nn.Module.__call__ and not own_registration(kind)
    return found


def global_hooks() -> bool:
    """Whether global module hooks exist: they run before a module's own hooks, and a wrapper
    would run after them, so every module is hooked to keep the order."""
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)


def _call_paths() -> tuple[Any, ...]:
    """The code of torch's module call path that calls ``forward``: ``_call_impl`` (no hooks) and
    its ``inner`` (hooks); empty when this torch has another shape, and then every module is hooked."""
    code = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)
    inner = [c for c in getattr(code, "co_consts", ()) if isinstance(c, types.CodeType) and c.co_name == "inner"]
    return (code, inner[0]) if code is not None and len(inner) == 1 else ()


CALLERS = _call_paths()
_CALL_IMPL, _INNER = CALLERS if CALLERS else (None, None)  # (when empty, nothing is wrapped)
_get_ident = threading.get_ident
_getframe = sys._getframe
_PLAIN_FORWARD: dict[type, bool] = {}
SLOT_LOCK = threading.Lock()  # guards instance forward slots across captures in several threads
ACTIVE_WRAPPERS: set[int] = set()  # ids of the wrappers in some module's slot now


def named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``dict(model.named_modules())``, walked directly: the generator chain (one frame per level
    for every module yielded) cost as much as attaching the hooks. One loop over a stack, in the
    same order (a module, then its children's subtrees in turn). A module type with its own
    ``named_modules`` is asked through it."""
    named: dict[str, nn.Module] = {}
    seen: set[int] = set()
    todo = [("", model)]
    pop, push = todo.pop, todo.extend
    plain = _NAMED_MODULES
    while todo:
        prefix, module = pop()
        if type(module).named_modules is not plain:
            return dict(model.named_modules())
        key = id(module)
        if key in seen:  # a shared module: once, under its first name
            continue
        seen.add(key)
        named[prefix] = module
        children = module._modules
        if children:
            stem = prefix + "." if prefix else ""
            # reversed onto the stack: the first child is walked next
            push([(stem + name, sub) for name, sub in reversed(children.items()) if sub is not None])
    return named


_NAMED_MODULES = nn.Module.named_modules
NO_FORWARD = object()
