"""Dotted-name helpers: find, list and replace submodules and parameters like baukit does.

Names are matched against ``named_modules()`` / ``named_parameters()`` (not
``get_submodule``), so a module reachable under two names answers only to the first,
exactly as in baukit. Deviations: a missing name raises ``SiteNotFoundError`` (a
``LookupError``, like baukit's) whose message lists the nearest valid names;
``replace_module`` also accepts an undotted name (baukit raises UnboundLocalError);
wrong argument types raise ``InvalidArgumentError`` (a ``TypeError``) instead of an
AttributeError or a failed assertion.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from torchlens.core.names import nearest
from torchlens.errors import InvalidArgumentError, SiteNotFoundError

__all__ = ["get_module", "get_parameter", "module_names", "parameter_names", "replace_module", "set_requires_grad"]


def _require_module(model: object, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"{what} needs a torch.nn.Module, got {type(model).__name__}",
            remedy="Pass the model (or the submodule) itself, not its output or a wrapper.",
        )
    return model


def _not_found(kind: str, model: nn.Module, name: object, names: Iterable[str]) -> SiteNotFoundError:
    close = nearest(str(name), [n for n in names if n])
    return SiteNotFoundError(
        f"{type(model).__name__} has no {kind} {name!r}; nearest: {', '.join(close) or '(none)'}",
        site=name,
        candidates=close,
    )


def module_names(model: nn.Module) -> list[str]:
    """Every module name of ``model``, '' (the model itself) first."""
    return [n for n, _ in _require_module(model, "module_names").named_modules()]


def parameter_names(model: nn.Module) -> list[str]:
    """Every parameter name of ``model``."""
    return [n for n, _ in _require_module(model, "parameter_names").named_parameters()]


def get_module(model: nn.Module, name: str) -> nn.Module:
    """The submodule called ``name`` ('' is the model); SiteNotFoundError if there is none."""
    for found, module in _require_module(model, "get_module").named_modules():
        if found == name:
            return module
    raise _not_found("module", model, name, module_names(model))


def get_parameter(model: nn.Module, name: str) -> nn.Parameter:
    """The parameter called ``name``; SiteNotFoundError if there is none."""
    for found, param in _require_module(model, "get_parameter").named_parameters():
        if found == name:
            return param
    raise _not_found("parameter", model, name, parameter_names(model))


def replace_module(model: nn.Module, name: str, new_module: nn.Module) -> None:
    """Put ``new_module`` where ``name`` points (the attribute is set even if it was absent)."""
    parent = _require_module(model, "replace_module")
    attr = name
    if "." in name:
        parent_name, attr = name.rsplit(".", 1)
        parent = get_module(model, parent_name)
    setattr(parent, attr, new_module)


def set_requires_grad(requires_grad: bool, *models: nn.Module | torch.Tensor) -> None:
    """Set ``requires_grad`` on every parameter of each module, or on each tensor given."""
    for model in models:
        if isinstance(model, nn.Module):
            for param in model.parameters():
                param.requires_grad = requires_grad
        elif isinstance(model, torch.Tensor):
            model.requires_grad = requires_grad
        else:
            raise InvalidArgumentError(
                f"set_requires_grad cannot set requires_grad on a {type(model).__name__}",
                remedy="Pass modules, parameters or tensors.",
            )
