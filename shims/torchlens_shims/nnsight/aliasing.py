"""``rename=`` aliases: which module a key names, and every spelling of a path under them.

``Envoy(module, rename={...})`` gives modules extra names. A key is read *from every
envoy of the tree*: a one-component key (``"mlp"``) binds wherever it resolves (each
block that has one), a dotted key (``"transformer.h"``, ``"h.0"``) binds on the envoy it
resolves from, a ``*`` component stands for any one entry (``"*.h"``: the ``h`` of
whichever child has one), and a class key binds on each envoy with exactly one child of
that class. A dotted alias (``{"attn.c_proj": "attn.o_proj"}``) binds on the envoy its
prefix names. An alias is a plain attribute pointing at the same envoy (`bind`).

`spellings` states the same rule on a path alone, before anything is bound, so an
``envoys=`` key written in an alias's name (``envoys={"layers.*": Block}``) picks the
envoy class of the module it names (`path_ends_with` is the component-wise match).
"""

from __future__ import annotations

from typing import Any

from ._node import ModuleNode
from .errors import RenameError

__all__ = ["bind", "claim", "named", "path_ends_with", "spellings"]


def _aliases_of(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _key_parts(key: str) -> list[str]:
    return key.lstrip(".").split(".")  # ".mlp" is "mlp": a leading dot changes nothing


def path_ends_with(path: str, key: str) -> bool:
    """Whether dotted ``path`` ends with dotted ``key``, component by component.

    Args:
        path: a full envoy path (``"model.layers.0"``).
        key: a dotted suffix; a ``*`` component matches any one component.

    Returns:
        ``True`` when the last components of ``path`` are those of ``key``:
        ``"layers.*"`` ends ``model.layers.0`` but neither ``model.layers`` nor
        ``model.layers.0.attn``.
    """
    parts, wanted = path.split("."), _key_parts(key)
    if len(wanted) > len(parts):
        return False
    tail = parts[len(parts) - len(wanted) :]
    return all(want in ("*", part) for want, part in zip(wanted, tail))


def spellings(rename: dict | None, path: str, module: Any = None) -> list[str]:
    """Every spelling of ``path`` under ``rename``, the native one first.

    A path is spelled as any spelling of its parent plus its last component, or, where
    a key names it from an ancestor, as any spelling of the envoy the alias binds on
    plus the alias. So under ``{"transformer.h": "layers", "attn": "self_attn"}``
    ``model.transformer.h.0.attn`` is also ``model.layers.0.self_attn``.

    Args:
        rename: the ``rename=`` mapping (``None``: no aliases).
        path: a full envoy path (its first component is the root's name).
        module: the module at ``path``, for class keys (they name it by type).

    Returns:
        The spellings, without repeats, the native path first.
    """
    parts = path.split(".")
    if len(parts) == 1:
        return [path]
    last = parts[-1]
    found = [f"{parent}.{last}" for parent in spellings(rename, ".".join(parts[:-1]))]
    for key, aliases in (rename or {}).items():
        if isinstance(key, type):
            if module is None or not isinstance(module, key):
                continue
            depth = 1
        elif isinstance(key, str):
            depth = len(_key_parts(key))
            # a key is read from an ancestor, never from the root's own name
            if depth >= len(parts) or not path_ends_with(path, key):
                continue
        else:
            continue
        for alias in _aliases_of(aliases):
            prefix, _, name = alias.rpartition(".")
            down = prefix.count(".") + 1 if prefix else 0
            if down >= depth:
                continue  # a prefix that is no ancestor binds nowhere (`bind` raises)
            host = ".".join(parts[: len(parts) - depth + down])
            found += [f"{spelled}.{name}" for spelled in spellings(rename, host)]
    return list(dict.fromkeys(found))


def named(envoy: ModuleNode, key: Any) -> list[tuple[str, Any]]:
    """The envoys ``key`` names when read from ``envoy``, as ``(relative path, envoy)`` pairs.

    A dotted key is walked attribute by attribute as user code would (so a served value
    on the way, ``block.output``, raises as reading it outside a trace does); a ``*``
    component stands for every child reached so far; a class key names each direct child
    whose module is an instance of it. A module reached twice (tied weights) counts once.
    """
    if isinstance(key, type):
        found = [(name, child) for name, child in envoy._child_map.items() if isinstance(child._module, key)]
    else:
        found = [("", envoy)]
        for part in _key_parts(key):
            reached = []
            for path, node in found:
                if part == "*":
                    if isinstance(node, ModuleNode):
                        reached += [(f"{path}.{name}", child) for name, child in node._child_map.items()]
                    continue
                try:
                    reached.append((f"{path}.{part}", getattr(node, part)))
                except AttributeError:
                    continue
            found = reached
        found = [(path[1:], node) for path, node in found if isinstance(node, ModuleNode)]
    unique: dict[int, tuple[str, Any]] = {}
    for path, node in found:
        unique.setdefault(id(node), (path, node))
    return list(unique.values())


def _describe(key: Any) -> str:
    return key.__name__ if isinstance(key, type) else repr(key)


def bind(root: ModuleNode, rename: dict) -> None:
    """Bind every alias of ``rename`` on the tree under ``root`` (see the module docstring).

    Args:
        root: the envoy the aliases were given to; every envoy under it reads each key.
        rename: ``{key: alias or [aliases]}``; a key is a dotted path (``*`` allowed)
            or a module class.

    Raises:
        RenameError: a key matches two modules from one envoy, a dotted alias's prefix
            is no ancestor of what the key names, or an alias would hide a name the
            envoy already answers to (see `claim`).
    """
    for envoy in root.modules():
        for key, aliases in rename.items():
            if not isinstance(key, (str, type)):
                continue
            matches = named(envoy, key)
            if len(matches) > 1:
                paths = ", ".join(path for path, _ in matches)
                raise RenameError(
                    f"rename: {_describe(key)} matches {len(matches)} modules under `{envoy.path}` ({paths}); "
                    "an alias names one module, so key those by name"
                )
            if not matches:
                continue  # a key written for another architecture: nothing to bind here
            path, target = matches[0]
            for alias in _aliases_of(aliases):
                host, relative, name = envoy, path, alias
                if "." in alias:
                    prefix, _, name = alias.rpartition(".")
                    if "*" in prefix or not path.startswith(prefix + "."):
                        raise RenameError(
                            f"rename={{{_describe(key)}: {alias!r}}}: the prefix {prefix!r} names no ancestor "
                            f"of {path!r} under `{envoy.path}`; a dotted alias binds on the envoy its prefix "
                            "names, so spell the start of the key's path (without `*`)"
                        )
                    host, relative = envoy.get(prefix), path[len(prefix) + 1 :]
                if claim(host, name, target, relative):
                    object.__setattr__(host, name, target)
                    host._aliases[name] = relative


def claim(holder: Any, name: str, envoy: Any, real: str) -> bool:
    """Whether ``holder.name`` may become an alias of ``envoy``; a `RenameError` when it would hide something.

    ``False`` (nothing to do) when the name already reaches that very envoy: an alias equal
    to the child's own name, or a second path to one shared module.
    """
    current = holder.__dict__.get(name)
    if current is envoy:
        return False
    where = f"rename={{{real!r}: {name!r}}}"
    if name in holder._aliases:
        raise RenameError(f"{where}: the alias {name!r} is already bound here from {holder._aliases[name]!r}")
    module = holder._module
    if name in module._modules:
        raise RenameError(f"{where}: the alias {name!r} would shadow the child module {name!r} of {holder.path}")
    if current is not None or name in ("interleaver",):
        raise RenameError(f"{where}: the alias {name!r} would shadow the envoy's own state {name!r}")
    owner = next((cls for cls in type(holder).__mro__ if name in vars(cls)), None)
    if owner is not None and owner is not object:
        raise RenameError(f"{where}: the alias {name!r} would shadow {owner.__name__}.{name}")
    if hasattr(module, name):
        raise RenameError(f"{where}: the alias {name!r} would shadow the module's own attribute {name!r}")
    return True
