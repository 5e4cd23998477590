"""baukit's ``nethook`` (Trace, TraceDict and helpers) on TorchLens's module-hook layer.

Semantics are baukit's: a Trace is live from construction until ``close()`` or the end
of its ``with`` block; ``.output`` is what the module returned after ``edit_output``
(the very object unless ``clone``/``detach``), ``.input`` the positional inputs (one
value if there was exactly one, else the tuple; keyword arguments are not kept); a
module called several times keeps its last call and is edited on every call; hooks of
nested Traces on one module run in construction order. An edit that works in place
and returns None edits the model but leaves ``.output`` None, exactly as baukit does.
The hooks themselves are TorchLens ``ModuleHooks``, attached in the constructor and
removed by ``close()``; ``StopForward`` is a plain Exception, as in baukit.

Deviations from baukit (each where baukit fails or cannot be matched):

* A missing layer raises ``SiteNotFoundError`` (a ``LookupError``) naming the nearest
  valid layers; a non-module raises ``InvalidArgumentError`` (a ``TypeError``).
* ``clone``/``detach``/``retain_grad`` pass ``None``, cache objects and other
  non-tensors through (baukit asserts), rebuild namedtuples by field, and do not ask
  integer tensors for gradients.
* ``edit_output`` may be any callable: bound methods and callable objects are called
  with the arguments they declare (baukit counts their ``self`` and raises TypeError).
* ``Trace(stop=True)`` whose block ends without the layer having run exits cleanly
  (baukit raises TypeError from ``issubclass(None, ...)``).
* ``TraceDict`` whose layer list has a missing name detaches the traces it had already
  attached before raising (baukit leaves them hooked); a plain string instead of a
  list of layers raises ``InvalidArgumentError`` (baukit hooks each character).
* ``replace_module`` accepts an undotted name (baukit raises UnboundLocalError).
* Where baukit fails an assertion (``set_requires_grad`` on a non-tensor, conflicting
  ``subsequence`` boundaries, descending into a non-Sequential) the shim raises
  ``InvalidArgumentError``; a ``subsequence`` boundary naming no layer raises
  ``LayerNotFoundError``, both the ``ValueError`` baukit raises and a
  ``SiteNotFoundError``.
* Hooks fire only for forwards run on the thread that created the Trace (the
  ``ModuleHooks`` rule that keeps a shared model's captures apart); baukit fires on all.
* Reading ``.output``/``.input`` before anything was retained raises AttributeError
  as in baukit, with a message saying why.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from torchlens.capture.hooks import CallInfo, ModuleHooks
from torchlens.errors import InvalidArgumentError

from ._calls import invoke_with_optional_args
from ._copying import recursive_copy
from ._modules import (
    get_module,
    get_parameter,
    module_names,
    parameter_names,
    replace_module,
    set_requires_grad,
)
from ._subsequence import LayerNotFoundError, hierarchical_subsequence, subsequence

__all__ = [
    "LayerNotFoundError",
    "StopForward",
    "Trace",
    "TraceDict",
    "get_module",
    "get_parameter",
    "hierarchical_subsequence",
    "invoke_with_optional_args",
    "module_names",
    "parameter_names",
    "recursive_copy",
    "replace_module",
    "set_requires_grad",
    "subsequence",
]


class StopForward(Exception):
    """Raised right after a ``stop=True`` layer ran, to skip the rest of the forward.

    The ``with`` block of the Trace/TraceDict that asked to stop swallows it; outside a
    ``with`` it reaches the caller of the model, who may catch it.
    """


class _HookHandle:
    """Stands in for baukit's ``Trace.registered_hook`` (code may call ``.remove()``)."""

    __slots__ = ("_trace",)

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def remove(self) -> None:
        self._trace.close()


def _resolve(module: nn.Module, layer: Any, table: dict[str, nn.Module] | None = None) -> nn.Module:
    """The module a Trace hooks: ``module`` itself for layer None, else the named one."""
    if layer is None:
        if not isinstance(module, nn.Module):
            raise InvalidArgumentError(
                f"Trace needs a torch.nn.Module, got {type(module).__name__}",
                remedy="Pass the model and a layer name, or the layer module itself.",
            )
        return module
    found = table.get(layer) if table is not None and isinstance(layer, str) else None
    return found if found is not None else get_module(module, layer)


def _swallows(stop: Any, exc_type: type[BaseException] | None) -> bool:
    return bool(stop) and exc_type is not None and issubclass(exc_type, StopForward)


class Trace(contextlib.AbstractContextManager):
    """Retain (and optionally edit) the output, and optionally the input, of one layer.

    ``layer`` is a dotted module name inside ``module``, or None to hook ``module``
    itself. Options: ``retain_output``/``retain_input`` choose what is kept,
    ``clone``/``detach`` how (see recursive_copy), ``retain_grad`` keeps ``.output.grad``
    after backward (the model then continues on a clone, so later in-place ops are
    safe), ``edit_output(output, layer, inputs)`` returns the value passed on (any
    subset of those parameters, see invoke_with_optional_args), ``stop`` ends the
    forward after the layer by raising StopForward.
    """

    def __init__(
        self,
        module: nn.Module,
        layer: str | None = None,
        retain_output: bool = True,
        retain_input: bool = False,
        clone: bool = False,
        detach: bool = False,
        retain_grad: bool = False,
        edit_output: Callable[..., Any] | None = None,
        stop: bool = False,
    ) -> None:
        self._attach(
            _resolve(module, layer),
            layer,
            retain_output,
            retain_input,
            clone,
            detach,
            retain_grad,
            edit_output,
            stop,
        )

    def _attach(
        self,
        target: nn.Module,
        layer: Any,
        retain_output: Any,
        retain_input: Any,
        clone: Any,
        detach: Any,
        retain_grad: Any,
        edit_output: Any,
        stop: Any,
    ) -> None:
        """Hook ``target`` now; the options are fixed from here on, as in baukit."""
        self.layer = layer
        self.stop = stop

        def after_layer(info: CallInfo, args: tuple, kwargs: dict, output: Any) -> Any:
            # Same order as baukit: edit first, so both retained values see the edit.
            if edit_output:
                output = invoke_with_optional_args(edit_output, output=output, layer=self.layer, inputs=args)
            if retain_input:
                self.input = recursive_copy(
                    args[0] if len(args) == 1 else args, clone=clone, detach=detach, retain_grad=False
                )
            if retain_output:
                self.output = recursive_copy(output, clone=clone, detach=detach, retain_grad=retain_grad)
                if retain_grad:
                    # The model goes on with a copy, so an in-place op downstream cannot
                    # clobber the tensor whose gradient is being retained.
                    output = recursive_copy(self.output, clone=True, detach=False)
            if stop:
                raise StopForward()
            return output

        self._hooks = ModuleHooks(target)
        self._hooks.on_output("", after_layer)
        self._hooks.__enter__()
        self.registered_hook = _HookHandle(self)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup failed: explain the usual cause.
        if name in ("output", "input"):
            raise AttributeError(
                f"Trace of {self.__dict__.get('layer')!r} has no {name} yet: run the model while the "
                f"trace is open (and keep retain_{name}=True)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> bool:
        self.close()
        return _swallows(self.stop, exc_type)

    def close(self) -> None:
        """Detach the hook; the retained values stay readable. Safe to call twice."""
        # Dropping the hooks object also drops its reference to the module, so a kept
        # Trace does not keep the model alive (baukit's handle does not either).
        hooks = self.__dict__.pop("_hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)


def _for_layer(option: Any, layer: Any) -> Any:
    """An option given as ``{layer: value}`` means value for that layer, None elsewhere."""
    return option.get(layer, None) if isinstance(option, dict) else option


class TraceDict(OrderedDict, contextlib.AbstractContextManager):
    """One Trace per named layer, in an OrderedDict keyed by layer name.

    Repeated names are traced once. Every option may be a single value or a
    ``{layer: value}`` dict; a shared ``edit_output`` receives the layer name as its
    ``layer`` argument. ``stop=True`` stops after the last-listed layer (last in the
    list, not in execution order).
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Iterable[str] | None = None,
        retain_output: bool | dict = True,
        retain_input: bool | dict = False,
        clone: bool | dict = False,
        detach: bool | dict = False,
        retain_grad: bool | dict = False,
        edit_output: Callable[..., Any] | dict | None = None,
        stop: bool = False,
    ) -> None:
        super().__init__()
        self.stop = stop
        if layers is None or isinstance(layers, (str, bytes)):
            raise InvalidArgumentError(
                f"TraceDict needs a list of layer names, got {type(layers).__name__} {layers!r}",
                remedy="Pass layers=[...], e.g. TraceDict(model, ['transformer.h.0']).",
            )
        unique = list(dict.fromkeys(layers))
        # One named_modules() walk for all layers (get_module per layer walks each time);
        # the first name of a shared module wins in both, so lookups agree.
        table = dict(module.named_modules()) if isinstance(module, nn.Module) else None
        try:
            for position, layer in enumerate(unique):
                trace = Trace.__new__(Trace)
                trace._attach(
                    _resolve(module, layer, table),
                    layer,
                    retain_output=_for_layer(retain_output, layer),
                    retain_input=_for_layer(retain_input, layer),
                    clone=_for_layer(clone, layer),
                    detach=_for_layer(detach, layer),
                    retain_grad=_for_layer(retain_grad, layer),
                    edit_output=_for_layer(edit_output, layer),
                    stop=stop and position == len(unique) - 1,
                )
                self[layer] = trace
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TraceDict:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> bool:
        self.close()
        return _swallows(self.stop, exc_type)

    def close(self) -> None:
        """Detach every layer's hook, last-attached first."""
        for trace in reversed(list(self.values())):
            trace.close()
