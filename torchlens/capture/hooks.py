"""Module hooks that are attached for one capture and always removed afterwards.

Every engine and both shims observe modules through this one class, so "the model is
left exactly as it was" is guaranteed in one place: hooks are attached on ``__enter__``
and removed in ``__exit__`` whatever the forward did, and they ignore calls made from
other threads (a model shared between threads sees only its own capture).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core.names import nearest
from ..errors import SiteNotFoundError

__all__ = ["CallInfo", "ForwardSlots", "ModuleHooks", "PostHook", "PreHook", "resolve_module"]

PreHook = Callable[["CallInfo", tuple, dict], Any]
PostHook = Callable[["CallInfo", tuple, dict, Any], Any]


class CallInfo:
    """One call of one module: enough for a callback to know where it is."""

    __slots__ = ("address", "module", "pass_index")

    def __init__(self, address: str, module: nn.Module, pass_index: int) -> None:
        self.address = address
        self.module = module
        self.pass_index = pass_index

    def __repr__(self) -> str:
        return f"CallInfo({self.address!r}, pass={self.pass_index})"


def resolve_module(model: nn.Module, address: str) -> nn.Module:
    """The submodule at ``address`` ('' is the model itself), or a SiteNotFoundError."""
    if address == "":
        return model
    try:
        return model.get_submodule(address)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise SiteNotFoundError(
            f"model {type(model).__name__} has no module {address!r}; nearest: {nearest(address, names)}",
            site=address,
            candidates=nearest(address, names),
        ) from None


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
        self._counts: dict[str, int] = {}
        self._open: dict[str, list[CallInfo]] = {}
        self._owner: int | None = None
        self._named: dict[str, nn.Module] | None = None

    def module(self, address: str) -> nn.Module:
        """The submodule at ``address``; one ``named_modules`` walk serves every lookup."""
        if self._named is None:
            self._named = dict(self.model.named_modules())
        found = self._named.get(address)
        return found if found is not None else resolve_module(self.model, address)

    def names(self) -> list[str]:
        """Every module address of the model (shared modules once, under their first name)."""
        self.module("")
        return list(self._named)

    def modules(self) -> list[nn.Module]:
        """Every module of the model (shared modules once), in ``names()`` order."""
        self.module("")
        return list(self._named.values())

    # -- registration ----------------------------------------------------------
    def on_input(self, address: str, fn: PreHook) -> None:
        if self._owner is not None:  # the attached hooks have their callbacks fixed
            raise RuntimeError("register callbacks before entering the hooks context")
        self.module(address)
        self._pre.setdefault(address, []).append(fn)

    def on_output(self, address: str, fn: PostHook) -> None:
        if self._owner is not None:  # the attached hooks have their callbacks fixed
            raise RuntimeError("register callbacks before entering the hooks context")
        self.module(address)
        self._post.setdefault(address, []).append(fn)

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
        for address in self.names():
            self._pre.setdefault(address, []).append(pre)
            self._post.setdefault(address, []).append(post)

    def passes(self, address: str) -> int:
        """How many calls of ``address`` have started since the hooks were attached."""
        return self._counts.get(address, 0)

    def reset_counts(self) -> None:
        self._counts.clear()
        self._open.clear()

    # -- lifetime --------------------------------------------------------------
    def __enter__(self) -> ModuleHooks:
        self._owner = threading.get_ident()
        pre, post, handles = self._pre, self._post, self._handles
        try:
            for address in dict.fromkeys([*pre, *post]):
                module = self.module(address)
                if address in pre:
                    handles.append(_attach(module, self._make_pre(address, module), pre=True))
                if address in post:
                    handles.append(_attach(module, self._make_post(address, module, address in pre), pre=False))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            if type(handle) is tuple:
                hooks, flags, hook_id = handle
                hooks.pop(hook_id, None)
                flags.pop(hook_id, None)
            else:
                handle.remove()
        self._handles.clear()
        self._owner = None

    # -- the hooks themselves ----------------------------------------------------
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
            info = CallInfo(address, module, n)
            open_passes.append(info)  # the post hook of this call gets the same record
            if single is not None:  # one callback (every capture's case): its result as is
                return single(info, args, kwargs)
            replaced = None
            for fn in callbacks:
                result = fn(info, args, kwargs)
                if result is not None:
                    args, kwargs = result
                    replaced = result
            return replaced

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
                info = CallInfo(address, module, n)
            if single is not None:
                return single(info, args, kwargs, output)
            replaced = None
            for fn in callbacks:
                result = fn(info, args, kwargs, output)
                if result is not None:
                    output = result
                    replaced = result
            return replaced

        return post_hook


def _attach(module: nn.Module, hook: Callable[..., Any], *, pre: bool) -> Any:
    """Add ``hook`` (with kwargs) to ``module``'s forward pre- or post-hooks; return what removes it.

    Every module of a model gets two hooks per capture, so ``RemovableHandle`` (two weak
    references per hook) was most of an every-op capture's setup: for modules that use
    ``nn.Module``'s own registration, the entries it would make are made directly (same id
    counter, same order), the kwargs flag first, so a forward in another thread never finds
    the hook without it. A module type that registers hooks its own way goes through its API.
    """
    if pre:
        if type(module).register_forward_pre_hook is not _REGISTER_PRE:
            return module.register_forward_pre_hook(hook, with_kwargs=True)
        hooks, flags = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
    else:
        if type(module).register_forward_hook is not _REGISTER_POST:
            return module.register_forward_hook(hook, with_kwargs=True)
        hooks, flags = module._forward_hooks, module._forward_hooks_with_kwargs
    hook_id = RemovableHandle.next_id
    RemovableHandle.next_id += 1
    flags[hook_id] = True
    hooks[hook_id] = hook
    return hooks, flags, hook_id


_REGISTER_PRE = nn.Module.register_forward_pre_hook
_REGISTER_POST = nn.Module.register_forward_hook
_NO_FORWARD = object()


class ForwardSlots:
    """Wrappers placed in modules' instance ``forward`` slot for one run, then restored.

    Some interventions cannot be hooks: PyTorch chooses a module's ``forward`` before its
    pre-hooks run, so a hook can neither skip a module nor read its output before the
    user's own hooks do. A wrapper in the instance slot can. Like ``ModuleHooks``, this
    is the one place that puts them in and takes them out: ``restore`` (or ``__exit__``)
    gives every slot back exactly what it held — an instance attribute, or nothing.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Module, Any]] = []

    def install(self, module: nn.Module, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """Put ``wrapper`` in ``module``'s forward slot; return the forward it stands in for."""
        own = module.__dict__
        previous = own.get("forward", _NO_FORWARD)
        self._saved.append((module, previous))
        forward = module.forward if previous is _NO_FORWARD else previous
        own["forward"] = wrapper
        return forward

    def restore(self) -> None:
        for module, previous in reversed(self._saved):
            own = module.__dict__
            if previous is _NO_FORWARD:
                own.pop("forward", None)
            else:
                own["forward"] = previous
        self._saved.clear()

    def __enter__(self) -> ForwardSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
