"""The `Envoy`: a mirror of one module, exposing its live values inside a trace.

``NNsight(module)`` builds an envoy per submodule, reachable by the module's own
attribute path (``model.transformer.h[5].mlp``). Inside a ``with model.trace(x):``
block an envoy's ``.output`` / ``.input`` / ``.inputs`` park the block until the
forward reaches that module and hand over the value (assigning swaps one in);
``.skip(v)`` replaces the module's whole forward. Outside a trace an envoy is a
thin proxy: unknown attributes fall through to the module, calling it calls the
module, ``print(model)`` shows the tree.

The values are served through TorchLens's `ModuleHooks` (see `interleaver`);
an envoy never patches the module itself.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _worker, aliasing
from ._blocks import find_block
from ._driver import drive
from ._node import ModuleNode
from ._served import Served, eproperty, first_input_repack, first_input_view
from .batching import Batcher
from .errors import BatchingNotSupportedError, NNsightDeprecationWarning, RemoteUnsupportedError
from .interleaver import Tree
from .source import Source
from .tracer import EditingTracer, InterleavingTracer, Iterations, ScanningTracer, Tracer

__all__ = ["Envoy", "NNsight", "traceable"]


def _check_remote(kwargs: dict) -> None:
    for key in ("remote", "backend"):
        value = kwargs.pop(key, None)
        if value:
            raise RemoteUnsupportedError(
                f"{key}={value!r} asks for execution on NDIF; the shim only runs the model here",
                option=key,
            )


def traceable(method: Callable) -> Callable:
    """A model method usable both ways: ``with model.generate(x):`` traces it, a plain call runs it."""

    @functools.wraps(method)
    def wrapper(self: Envoy, *args: Any, **kwargs: Any) -> Any:
        if self._tree.run is not None:  # called by the run itself
            return method(self, *args, **kwargs)
        _check_remote(kwargs)
        bound = method.__get__(self, type(self))
        if find_block(sys._getframe(1)) is None:
            return self.interleave(bound, *args, **kwargs)
        return self.trace(*args, fn=bound, **kwargs)

    return wrapper


def _addindent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    first = lines.pop(0)
    return first + "\n" + "\n".join(" " * spaces + line for line in lines)


class Envoy(ModuleNode):
    """Mirror of one ``torch.nn.Module``; see the module docstring.

    Attributes:
        path: dotted location, ``"model"`` for the root (``"model.transformer.h.0"``);
            every served location is ``"{path}.output"`` etc.
    """

    OVERLOAD_PREFIX = "E_"

    def __init__(
        self,
        module: torch.nn.Module,
        path: str = "model",
        tree: Tree | None = None,
        envoys: Any = None,
        parent: Envoy | None = None,
        rename: dict | None = None,
    ) -> None:
        object.__setattr__(self, "_parent", weakref.ref(parent) if parent is not None else None)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_tree", tree if tree is not None else Tree())
        self._tree.envoys[id(module)] = self
        object.__setattr__(self, "_edits", [])
        object.__setattr__(self, "_envoys", envoys)
        object.__setattr__(self, "_rename", rename)
        object.__setattr__(self, "_aliases", {})
        object.__setattr__(self, "_children", [])
        object.__setattr__(self, "_child_map", {})
        object.__setattr__(self, "_standalone", [])
        object.__setattr__(self, "_hooksets", [])  # the hook sets of its last run (see `drive`)
        for name, child in list(module._modules.items()):
            if child is not None:
                self._wrap_envoy(name, child)
        if rename:
            aliasing.bind(self, rename)

    # -- the tree ------------------------------------------------------------------
    def _wrap_envoy(self, name: str, module: torch.nn.Module) -> Envoy:
        attribute = name
        if not name.startswith("_") and _is_served_name(name):
            attribute = f"{self.OVERLOAD_PREFIX}{name}"
        existing = self.__dict__.get(attribute)
        index = None
        if isinstance(existing, Envoy):
            if existing in self._children:
                index = self._children.index(existing)
            if self._tree.envoys.get(id(existing._module)) is existing:
                del self._tree.envoys[id(existing._module)]
        shared = self._tree.envoys.get(id(module))
        if shared is not None:
            envoy = shared
            if shared is not self:
                self._aliases[attribute] = shared.path
            if index is not None:
                del self._children[index]
        else:
            envoy_cls = self._envoy_class(module, f"{self.path}.{name}")
            envoy = envoy_cls(
                module,
                path=f"{self.path}.{name}",
                tree=self._tree,
                envoys=self._envoys,
                parent=self,
                rename=None,
            )
            if index is None:
                self._children.append(envoy)
            else:
                self._children[index] = envoy
            if attribute != name:
                self._aliases[attribute] = name
                warnings.warn(
                    f"Module '{self.path}' has a submodule named '{name}', which nnsight already "
                    f"serves on every module. The submodule is '.{attribute}' here; '.{name}' stays "
                    "the module's output.",
                    stacklevel=2,
                )
        if self._module._modules.get(name) is module:
            self._child_map[name] = envoy
        object.__setattr__(self, attribute, envoy)
        return envoy

    def _envoy_class(self, module: torch.nn.Module, path: str) -> type[Envoy]:
        """The envoy class ``envoys=`` gives the module at ``path`` (by class, then by path suffix).

        A string key matches the native path first; failing that, any spelling of the path
        under the root's ``rename=`` aliases (``envoys={"layers.*": Block}`` beside
        ``rename={"transformer.h": "layers"}``).
        """
        mapping = self._envoys
        if mapping is None:
            return Envoy
        if isinstance(mapping, type):
            return mapping
        for cls in type(module).__mro__:
            if cls in mapping:
                return mapping[cls]
        keys = [(key, cls) for key, cls in mapping.items() if isinstance(key, str)]
        for key, envoy_cls in keys:
            if aliasing.path_ends_with(path, key):
                return envoy_cls
        rename = self.root._rename
        if keys and rename:
            for spelled in aliasing.spellings(rename, path, module)[1:]:
                for key, envoy_cls in keys:
                    if aliasing.path_ends_with(spelled, key):
                        return envoy_cls
        return Envoy

    def _named_children(self) -> list[tuple[str, Envoy]]:
        named = list(self._child_map.items())
        bound = {id(child) for child in self._child_map.values()}
        named.extend(
            (child.path.rsplit(".", 1)[-1], child) for child in self._children if id(child) not in bound
        )
        return named

    @property
    def parent(self) -> Envoy | None:
        return self._parent() if self._parent is not None else None

    @property
    def interleaver(self) -> Tree:
        """The state every envoy of this model shares (nnsight's name for it); freed with the model."""
        return self._tree

    @property
    def root(self) -> Envoy:
        envoy = self
        while (parent := envoy.parent) is not None:
            envoy = parent
        return envoy

    @property
    def _model(self) -> torch.nn.Module:
        """The wrapped module (as the migration guide spells it; nnsight itself uses ``_module``)."""
        return self._module

    # -- served values ------------------------------------------------------------------
    output = Served("output", doc="The module's forward output; read or replace it during a trace.")
    inputs = Served("input", doc="The module's forward inputs as an ``(args, kwargs)`` pair.")
    input = Served(
        "input",
        view=first_input_view,
        repack=first_input_repack,
        doc="The module's first input (first positional, else first keyword argument).",
    )

    def skip(self, replacement: Any) -> None:
        """Do not run this module's forward; ``replacement`` becomes its output."""
        _worker.skip(f"{self.path}.skip", replacement)

    @property
    def source(self) -> Any:
        """Operation-level access inside this module's forward (``.source.<op>_<n>``)."""
        return Source(self)

    @property
    def iter(self) -> Any:
        warnings.warn("model.iter is deprecated; use tracer.iter instead.", NNsightDeprecationWarning, stacklevel=2)
        return Iterations()

    def all(self) -> Any:
        warnings.warn(
            "model.all() is deprecated; use tracer.all() instead.", NNsightDeprecationWarning, stacklevel=2
        )
        return Iterations()[:]

    # -- opening runs ----------------------------------------------------------------------
    def trace(
        self,
        *args: Any,
        fn: Any = None,
        trace: bool = True,
        tracer_cls: type[InterleavingTracer] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Open a trace: ``with model.trace(x):`` runs the model once beside the body."""
        _check_remote(kwargs)
        if fn is None:
            fn = "__call__"
        if not trace:
            return self.interleave(fn, *args, **kwargs)
        return (tracer_cls or InterleavingTracer)(self, fn, *args, **kwargs)

    def scan(self, *args: Any, fn: Any = None, **kwargs: Any) -> ScanningTracer:
        """Like `trace`, but the forward runs on fake tensors: shapes and dtypes, no compute."""
        _check_remote(kwargs)
        return ScanningTracer(self, fn or "__call__", *args, **kwargs)

    def edit(self, *, inplace: bool = False, **kwargs: Any) -> EditingTracer:
        """Record the block as a default intervention replayed on every later trace."""
        _check_remote(kwargs)
        return EditingTracer(self, inplace=inplace)

    def clear_edits(self) -> None:
        self._edits = []

    def session(self, *, tracer_cls: type[Tracer] | None = None, **kwargs: Any) -> Tracer:
        """A scope for several traces that share values; only saved ones leave it."""
        _check_remote(kwargs)
        return (tracer_cls or Tracer)()

    def _shallow_copy(self) -> Envoy:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy._edits = list(self._edits)
        return copy

    # -- batching (overridden by models that can batch) -----------------------------------------
    _batcher_class: type[Batcher] = Batcher

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        return 1 if (inputs or kwargs) else 0

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        if not invokes:
            return (), {}
        if len(invokes) == 1:
            return invokes[0]
        raise BatchingNotSupportedError(f"{type(self).__name__} does not support batching multiple invokes")

    def _standalone_modules(self) -> list[tuple[torch.nn.Module, str]]:
        """Modules outside the wrapped model whose values a run also serves (a generator)."""
        return [(envoy._module, envoy.path) for envoy in self._standalone]

    def interleave(
        self,
        fn: Any,
        *args: Any,
        workers: list[_worker.Worker] | None = None,
        batcher: Batcher | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn`` (the model call) with the blocks as workers; return what it returned."""
        return drive(self, fn, args, kwargs, workers=workers, batcher=batcher)

    # -- plain module behaviour ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("_module")
        if module is None or not hasattr(module, name):
            raise AttributeError(f"{type(self).__name__!r} object (nor its module) has attribute {name!r}")
        value = getattr(module, name)
        if isinstance(value, torch.nn.Module):
            return self._wrap_envoy(name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, torch.nn.Module) and not name.startswith("_"):
            self._module.add_module(name, value)
            self._wrap_envoy(name, value)
        else:
            object.__setattr__(self, name, value)

    def __call__(self, *args: Any, hook: bool = False, **kwargs: Any) -> Any:
        """Call the module; inside a trace, off the record unless ``hook=True``."""
        run = self._tree.run
        if run is not None and not hook:
            owner, run.owner = run.owner, None
            try:
                return self._module(*args, **kwargs)
            finally:
                run.owner = owner
        return self._module(*args, **kwargs)

    def __iter__(self) -> Iterator[Envoy]:
        return iter([child for _, child in self._named_children()])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [child for _, child in self._named_children()][key]
        if isinstance(key, int) and key < 0:
            key += len(self)
        return getattr(self, str(key))

    def __len__(self) -> int:
        return len(self._module)

    def __bool__(self) -> bool:
        return bool(self._module)

    def get(self, path: str) -> Any:
        obj: Any = self
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def modules(self, include_fn: Callable[[Envoy], bool] | None = None, names: bool = False) -> list[Any]:
        result: list[Any] = []
        seen: set[int] = set()
        stack: list[tuple[Envoy, bool]] = [(self, False)]
        while stack:
            envoy, expanded = stack.pop()
            if expanded:
                if include_fn is None or include_fn(envoy):
                    result.append((envoy.path, envoy) if names else envoy)
                continue
            if id(envoy) in seen:
                continue
            seen.add(id(envoy))
            stack.append((envoy, True))
            for _, child in reversed(envoy._named_children()):
                stack.append((child, False))
        return result

    def named_modules(self, include_fn: Callable[[Envoy], bool] | None = None) -> list[tuple[str, Envoy]]:
        return self.modules(include_fn=include_fn, names=True)

    def to(self, *args: Any, **kwargs: Any) -> Envoy:
        self._module.to(*args, **kwargs)
        return self

    def cpu(self, *args: Any, **kwargs: Any) -> Envoy:
        self._module.cpu(*args, **kwargs)
        return self

    def cuda(self, *args: Any, **kwargs: Any) -> Envoy:
        self._module.cuda(*args, **kwargs)
        return self

    @property
    def device(self) -> torch.device | None:
        try:
            return next(self._module.parameters()).device
        except StopIteration:
            return None

    @property
    def devices(self) -> set[torch.device]:
        return {parameter.device for parameter in self._module.parameters()}

    # -- printing ------------------------------------------------------------------------
    def _name(self) -> str:
        return self._module._get_name()

    def _repr_modulelist(self) -> str:
        reprs = [repr(child) for child in self]
        spans = [[0, 0]]
        blocks = [reprs[0]]
        for index, text in enumerate(reprs[1:], 1):
            if text == blocks[-1]:
                spans[-1][1] += 1
                continue
            spans.append([index, index])
            blocks.append(text)
        lines = []
        for (start, end), text in zip(spans, blocks):
            line = f"({start}): {text}" if start == end else f"({start}-{end}): {end - start + 1} x {text}"
            lines.append(_addindent(line, 2))
        return self._name() + "(\n  " + "\n  ".join(lines) + "\n)"

    def __repr__(self) -> str:
        if self._child_map and isinstance(self._module, torch.nn.ModuleList):
            return self._repr_modulelist()
        extra = self._module.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        direct: dict[str, list[str]] = {}
        mounts: list[str] = []
        for alias, target in self._aliases.items():
            if "." in target:
                mounts.append(alias)
            else:
                direct.setdefault(target, []).append(alias)
        child_lines = []
        for name, child in self._named_children():
            label = "/".join([*direct.get(name, []), name])
            child_lines.append(f"({label}): " + _addindent(repr(child), 2))
        for alias in mounts:
            if alias in self._child_map:
                continue
            child_lines.append(f"({alias}): " + _addindent(repr(getattr(self, alias)), 2))
        # served values a subclass describes (``eproperty(description=...)``), one line each
        described = {
            name: value
            for cls in reversed(type(self).__mro__)
            for name, value in vars(cls).items()
            if isinstance(value, eproperty) and value.description
        }
        child_lines += [str(value) for value in described.values()]
        lines = extra_lines + child_lines
        text = self._name() + "("
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                text += extra_lines[0]
            else:
                text += "\n  " + "\n  ".join(lines) + "\n"
        return text + ")"


def _is_served_name(name: str) -> bool:
    return inspect.isdatadescriptor(getattr(Envoy, name, None))


class NNsight(Envoy):
    """Wrap any ``torch.nn.Module`` for tracing: ``model = NNsight(module)``."""
