"""Module hooks that are attached for one capture and always removed afterwards.

Every engine and both shims observe modules through this one class, so "the model is
left exactly as it was" is guaranteed in one place: hooks are attached on ``__enter__``
and removed in ``__exit__`` whatever the forward did, and they ignore calls made from
other threads (a model shared between threads sees only its own capture). Callbacks on
every module (an every-op capture's) reach a module without hooks of its own through a
wrapper in its instance ``forward`` slot, which runs where a hook attached last would run
and spares torch's hooked call path; ``__exit__`` gives each slot back what it held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .._interrupts import HoldInterrupts, interrupts_held
from ..core.names import nearest
from ..errors import SiteNotFoundError
from ._copies import forget_hooks, forget_slot, hold_types, note_hooks, note_slot, release_types
from ._interpose import (
    CALLERS,
    NO_FORWARD,
    SLOT_LOCK,
    CallInfo,
    PostHook,
    PreHook,
    attach,
    global_hooks,
    named_modules,
    new_tuple,
    own_registration,
    run_post,
    run_pre,
    unwrap,
    wrap_every,
)

__all__ = ["CallInfo", "ForwardSlots", "ModuleHooks", "PostHook", "PreHook", "resolve_module"]

def resolve_module(model: nn.Module, address: str) -> nn.Module:
    """The submodule at ``address`` ('' is the model itself), or a SiteNotFoundError.

    What ``model.get_submodule(address)`` returns. Every capture resolves its sites several
    times, and ``get_submodule`` (a ``hasattr`` and a ``getattr`` through ``Module.__getattr__``
    per name) was a good part of a module read's fixed cost: a name that only ``_modules``
    holds, of a module type whose attribute lookup is torch's own, is read from ``_modules``
    directly (what ``getattr`` would end up returning); anything else asks ``get_submodule``.
    """
    if address == "":
        return model
    module = model
    names = _CLASS_NAMES
    for name in address.split("."):
        found = module._modules.get(name)
        shadowed = names.get(type(module)) or _class_names(type(module))
        if found is None or name in shadowed or name in module.__dict__:
            return _get_submodule(model, address)
        module = found
    return module


def _get_submodule(model: nn.Module, address: str) -> nn.Module:
    try:
        return model.get_submodule(address)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise SiteNotFoundError(
            f"model {type(model).__name__} has no module {address!r}; nearest: {nearest(address, names)}",
            site=address,
            candidates=nearest(address, names),
        ) from None


_CLASS_NAMES: dict[type, Any] = {}  # module type -> names its classes define (all names: a custom lookup)
_EVERY_NAME = type("_EveryName", (), {"__contains__": lambda self, name: True})()


def _class_names(kind: type) -> Any:
    """The attribute names ``kind``'s classes define, which ``getattr`` finds before ``_modules``
    (or, for a type with its own ``__getattr__``/``__getattribute__``, every name: ask it)."""
    if kind.__getattr__ is not nn.Module.__getattr__ or kind.__getattribute__ is not object.__getattribute__:
        found: Any = _EVERY_NAME
    else:
        found = frozenset(name for klass in kind.__mro__ for name in vars(klass))
    _CLASS_NAMES[kind] = found
    return found


class ModuleHooks:
    """Pre/post callbacks on named submodules, live only inside ``with``.

    Callbacks for one module run in registration order. A pre callback may return
    ``(args, kwargs)`` to replace the call's inputs; a post callback may return a
    replacement output (``None`` keeps the current one), which later callbacks see.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._pre: dict[str, list[PreHook]] = {}
        self._post: dict[str, list[PostHook]] = {}
        self._handles: list[Any] = []
        self._direct: list[tuple] = []  # (pre dict, pre kwargs flags, id, post dict, post flags, id) per module
        self._slots: list[tuple[nn.Module, Any, Any]] = []  # (module, what its forward slot held, our wrapper)
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[CallInfo]] = {}
        self._owner: int | None = None
        self._named: dict[str, nn.Module] | None = None
        self._found: dict[str, nn.Module] = {}  # addresses looked up so far
        # Callbacks on every module (``on_every_module``): kept once, not copied into a list per
        # address, so a capture attaches two shared hooks per module and builds no closures.
        self._every: list[tuple[PreHook, PostHook]] = []
        self._noted: list[Any] = []  # our hook callables, and the module types whose copies leave them out
        self._held: list[type] = []

    def module(self, address: str) -> nn.Module:
        """The submodule at ``address``: from the ``named_modules`` walk once some caller needed it
        (every-module callbacks), else resolved alone (a read of a few modules walks no others)."""
        found = self._found.get(address)
        if found is None:
            found = self._named.get(address) if self._named is not None else None
            if found is None:
                found = resolve_module(self.model, address)
            self._found[address] = found  # the tree does not change between registering and attaching
        return found

    def _walk(self) -> dict[str, nn.Module]:
        if self._named is None:
            self._named = named_modules(self.model)
        return self._named

    def names(self) -> list[str]:
        """Every module address of the model (shared modules once, under their first name)."""
        return list(self._walk())

    def named(self) -> dict[str, nn.Module]:
        """Every module of the model by address (shared modules once, under their first name)."""
        return self._walk()

    def modules(self) -> list[nn.Module]:
        """Every module of the model (shared modules once), in ``names()`` order."""
        return list(self._walk().values())

    # -- registration ----------------------------------------------------------
    def on_input(self, address: str, fn: PreHook) -> None:
        if self._owner is not None:  # the attached hooks have their callbacks fixed
            raise RuntimeError("register callbacks before entering the hooks context")
        self.module(address)
        self._own_lists(address)[0].append(fn)

    def on_output(self, address: str, fn: PostHook) -> None:
        if self._owner is not None:  # the attached hooks have their callbacks fixed
            raise RuntimeError("register callbacks before entering the hooks context")
        if address not in self._found:
            self.module(address)
        post = self._post.get(address)
        (post if post is not None else self._own_lists(address)[1]).append(fn)

    def _own_lists(self, address: str) -> tuple[list[PreHook], list[PostHook]]:
        """``address``'s own callback lists, started with the every-module callbacks registered
        so far (callbacks for one module run in registration order)."""
        pre, post = self._pre, self._post
        if address not in pre:
            if not self._every:  # (a read's case)
                pre[address], post[address] = [], []
                return pre[address], post[address]
            # An alias of a shared module is not one of ``names()``: every-module callbacks run
            # for the module under its first name only.
            every = self._every if address in self._walk() else ()
            pre[address] = [p for p, _ in every]
            post[address] = [p for _, p in every]
        return pre[address], post[address]

    def on_every_module(self, pre: PreHook, post: PostHook) -> None:
        """``pre`` and ``post`` on every module of the model (shared modules once).

        Args:
            pre: called as each module call starts (see ``on_input``).
            post: called as each module call returns (see ``on_output``).

        Raises:
            RuntimeError: the hooks are attached already (inside ``with``).
        """
        if self._owner is not None:
            raise RuntimeError("register callbacks before entering the hooks context")
        named = self._walk()
        self._every.append((pre, post))
        for address in self._pre:  # modules with callbacks of their own (aliases excepted)
            if address in named:
                self._pre[address].append(pre)
                self._post[address].append(post)

    def passes(self, address: str) -> int:
        """How many calls of ``address`` have started since the hooks were attached."""
        return self._counts.get(address, 0)

    def reset_counts(self) -> None:
        self._counts.clear()
        self._open.clear()

    # -- lifetime --------------------------------------------------------------
    def __enter__(self) -> ModuleHooks:
        self._owner = threading.get_ident()
        try:
            if interrupts_held():  # (inside ``Attached``, every capture's case)
                self._attach()
            else:
                with HoldInterrupts():  # a Ctrl-C meanwhile is raised once every hook is on, then all come off
                    self._attach()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _attach(self) -> None:
        pre, post, handles, found = self._pre, self._post, self._handles, self._found
        # (every address with callbacks was looked up as they were registered)
        self._held = hold_types(self.modules() if self._every else [found[a] for a in pre])
        for address in pre:
            module = found[address]
            if pre[address]:
                handles.append(attach(module, self._make_pre(address, module), pre=True))
            if post[address]:
                handles.append(attach(module, self._make_post(address, module, bool(pre[address])), pre=False))
        if self._every:
            self._attach_every()

    def __exit__(self, *exc: object) -> None:
        if interrupts_held():
            self._detach()
            return
        with HoldInterrupts():  # a Ctrl-C meanwhile is raised once every hook and wrapper is off
            self._detach()

    def _detach(self) -> None:
        if self._slots:
            with SLOT_LOCK:
                unwrap(self._slots)  # each slot back to what it held
            self._slots.clear()
        for pre_hooks, pre_flags, pre_id, post_hooks, post_flags, post_id in self._direct:
            pre_hooks.pop(pre_id, None)
            pre_flags.pop(pre_id, None)
            post_hooks.pop(post_id, None)
            post_flags.pop(post_id, None)
        self._direct.clear()
        for handle in self._handles:
            if type(handle) is tuple:
                hooks, flags, hook_id = handle
                hooks.pop(hook_id, None)
                flags.pop(hook_id, None)
            else:
                handle.remove()
        self._handles.clear()
        forget_hooks(*self._noted)
        self._noted.clear()
        release_types(self._held)
        self._held = []
        self._owner = None

    # -- the hooks themselves ----------------------------------------------------
    def _attach_every(self) -> None:
        """The every-module callbacks on every module without callbacks of its own: a wrapper in
        its forward slot where that keeps the order of hooks, else two hooks shared by all modules
        (the module a hook is called for says which address it is: one dict read per call, not
        two closures per module and capture, which were most of an every-op capture's fixed cost)."""
        every = self._every
        pre_fn, post_fn = every[0] if len(every) == 1 else (None, None)
        counts = self._counts
        owner = self._owner
        get_ident = threading.get_ident
        where: dict[int, tuple[str, list[CallInfo]]] = {}
        own = self._pre

        def pre_hook(mod, args, *rest):
            # ``*rest``: as in the hooks of ``_make_pre``.
            if get_ident() != owner or not rest:
                return None
            address, open_passes = where[id(mod)]
            n = counts.get(address, 0) + 1
            counts[address] = n
            info = CallInfo(address, mod, n)
            open_passes.append(info)  # the post hook of this call gets the same record
            if pre_fn is not None:
                return pre_fn(info, args, rest[0])
            return run_pre([p for p, _ in every], info, args, rest[0])

        def post_hook(mod, args, *rest):
            if get_ident() != owner or len(rest) != 2:
                return None
            address, open_passes = where[id(mod)]
            info = open_passes.pop() if open_passes else CallInfo(address, mod, counts.get(address, 0))
            if post_fn is not None:
                return post_fn(info, args, rest[0], rest[1])
            return run_post([p for _, p in every], info, args, rest[0], rest[1])

        note_hooks(pre_hook, post_hook)
        self._noted += (pre_hook, post_hook)
        opens = self._open
        slots = self._slots
        # Without a hook of its own, a module is wrapped in its instance ``forward`` slot instead:
        # torch then keeps its hook-free call path (hooks cost several us per module call) and
        # the wrapper runs exactly where our hooks would: around forward, after no other hook.
        wrap = pre_fn is not None and post_fn is not None and CALLERS and not global_hooks()
        if wrap:
            SLOT_LOCK.acquire()  # two captures of one model in two threads: one wraps, the other hooks
        try:
            if wrap:
                rest = wrap_every(self._named, own, pre_fn, post_fn, counts, owner, slots)
            else:
                rest = [(address, module) for address, module in self._named.items() if address not in own]
            for address, module in rest:
                where[id(module)] = (address, opens.setdefault(address, []))
                self._hook_every(module, pre_hook, post_hook)
        finally:
            if wrap:
                SLOT_LOCK.release()

    def _hook_every(self, module: nn.Module, pre_hook: Callable[..., Any], post_hook: Callable[..., Any]) -> None:
        """Attach the shared every-module hooks to ``module``."""
        if own_registration(type(module)):
            self._handles.append(attach(module, pre_hook, pre=True))
            self._handles.append(attach(module, post_hook, pre=False))
            return
        # torch's own entries, as ``attach`` makes them (kwargs flag first), inlined: this runs
        # for every module of the model on every capture.
        pre_id = RemovableHandle.next_id
        post_id = RemovableHandle.next_id = pre_id + 1
        RemovableHandle.next_id = post_id + 1
        pre_hooks, pre_flags = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
        post_hooks, post_flags = module._forward_hooks, module._forward_hooks_with_kwargs
        pre_flags[pre_id] = True
        pre_hooks[pre_id] = pre_hook
        post_flags[post_id] = True
        post_hooks[post_id] = post_hook
        self._direct.append((pre_hooks, pre_flags, pre_id, post_hooks, post_flags, post_id))

    def _make_pre(self, address: str, module: nn.Module):
        callbacks = self._pre[address]
        counts = self._counts
        open_passes = self._open.setdefault(address, [])
        owner = self._owner  # made in __enter__, removed in __exit__ by this same thread
        get_ident = threading.get_ident
        single = callbacks[0] if len(callbacks) == 1 else None  # callbacks are fixed once entered

        def pre_hook(mod, args, *rest):
            # ``*rest``: another thread's forward may run this hook while torch is still
            # registering it (hook added, with_kwargs flag not yet), without kwargs.
            if get_ident() != owner or not rest:
                return None
            kwargs = rest[0]
            n = counts.get(address, 0) + 1
            counts[address] = n
            info = new_tuple(CallInfo, (address, module, n))  # (CallInfo's own __new__, without its frame)
            open_passes.append(info)  # the post hook of this call gets the same record
            if single is not None:  # one callback (every capture's case): its result as is
                return single(info, args, kwargs)
            return run_pre(callbacks, info, args, kwargs)

        note_hooks(pre_hook)
        self._noted.append(pre_hook)
        return pre_hook

    def _make_post(self, address: str, module: nn.Module, counted_by_pre: bool):
        callbacks = self._post[address]
        counts = self._counts
        open_passes = self._open.setdefault(address, [])
        owner = self._owner
        get_ident = threading.get_ident
        single = callbacks[0] if len(callbacks) == 1 else None

        def post_hook(mod, args, *rest):
            # ``*rest`` as in pre_hook: (kwargs, output), or (output,) mid-registration elsewhere.
            if get_ident() != owner or len(rest) != 2:
                return None
            kwargs, output = rest
            if counted_by_pre:
                info = open_passes.pop() if open_passes else CallInfo(address, module, counts.get(address, 0))
            else:
                n = counts.get(address, 0) + 1
                counts[address] = n
                info = new_tuple(CallInfo, (address, module, n))  # (CallInfo's own __new__, without its frame)
            if single is not None:
                return single(info, args, kwargs, output)
            return run_post(callbacks, info, args, kwargs, output)

        note_hooks(post_hook)
        self._noted.append(post_hook)
        return post_hook


class ForwardSlots:
    """Wrappers placed in modules' instance ``forward`` slot for one run, then restored.

    Some interventions cannot be hooks: PyTorch chooses a module's ``forward`` before its
    pre-hooks run, so a hook can neither skip a module nor read its output before the
    user's own hooks do. A wrapper in the instance slot can. Like ``ModuleHooks``, this
    is the one place that puts them in and takes them out: ``restore`` (or ``__exit__``)
    gives every slot back exactly what it held — an instance attribute, or nothing.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Module, Any, Any]] = []
        self._held: list[type] = []  # module types whose copies leave the wrappers out

    def install(self, module: nn.Module, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """Put ``wrapper`` in ``module``'s forward slot; return the forward it stands in for."""
        own = module.__dict__
        previous = own.get("forward", NO_FORWARD)
        self._saved.append((module, previous, wrapper))
        self._held += hold_types([module])
        forward = module.forward if previous is NO_FORWARD else previous
        own["forward"] = wrapper
        note_slot(wrapper, previous, NO_FORWARD)
        return forward

    def restore(self) -> None:
        with HoldInterrupts():  # every slot back, also when Ctrl-C is pressed meanwhile
            for module, previous, wrapper in reversed(self._saved):
                own = module.__dict__
                forget_slot(wrapper)
                if previous is NO_FORWARD:
                    own.pop("forward", None)
                else:
                    own["forward"] = previous
            self._saved.clear()
            release_types(self._held)
            self._held = []

    def __enter__(self) -> ForwardSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
