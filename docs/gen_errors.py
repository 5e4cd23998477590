"""mkdocs hook: write the errors page from ``torchlens.errors`` at build time.

The page ``docs/errors.md`` holds only an introduction and the marker below; every class,
its family, its docstring and its remedy come from the code, so a new error class or a
changed remedy reaches the site without anyone editing Markdown. ``tests/test_docs.py``
fails when a class returned by ``torchlens.errors.all_error_classes()`` is missing from
the built page.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

MARKER = "<!-- torchlens:errors -->"
PAGE = "errors.md"
SHIM_MODULES = ("torchlens_shims.nnsight", "torchlens_shims.baukit")

log = logging.getLogger("mkdocs.hooks.gen_errors")


def _doc(cls: type) -> str:
    """The class's own docstring (not an inherited one), as one paragraph."""
    text = cls.__dict__.get("__doc__") or ""
    return " ".join(inspect.cleandoc(text).split()) if text else ""


def _builtin_bases(cls: type) -> list[str]:
    """Standard exceptions the class also is, so callers know what else catches it."""
    names = []
    for base in cls.__mro__[1:]:
        if base.__module__ == "builtins" and base not in (Exception, BaseException, object):
            names.append(base.__name__)
    return names


def _family(cls: type, root: type) -> str:
    """The nearest TorchLens ancestor below the root (``SiteError`` for ``SiteNotFoundError``)."""
    for base in cls.__mro__[1:]:
        if issubclass(base, root) and base is not root:
            return base.__name__
    return root.__name__ if cls is not root else "—"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "—"


def _section(cls: type, root: type) -> list[str]:
    parents = [b.__name__ for b in cls.__bases__]
    lines = [f"### {cls.__name__}", ""]
    lines.append(f"`{cls.__module__}.{cls.__name__}` — subclass of {', '.join(f'`{p}`' for p in parents)}.")
    lines.append("")
    doc = _doc(cls)
    if doc:
        lines += [doc, ""]
    remedy = getattr(cls, "remedy", "")
    if remedy:
        lines += [f"**Remedy:** {remedy}", ""]
    else:
        lines += ["**Remedy:** none of its own; a family base. Each raise carries one, and its "
                  "subclasses set theirs.", ""]
    also = _builtin_bases(cls)
    if also:
        lines += [f"Also caught by `except {'/'.join(also)}`.", ""]
    return lines


def _table(classes: list[type], root: type) -> list[str]:
    rows = ["| Error | Family | Remedy |", "| --- | --- | --- |"]
    for cls in classes:
        anchor = cls.__name__.lower()
        rows.append(f"| [{cls.__name__}](#{anchor}) | {_family(cls, root)} | "
                    f"{_cell(getattr(cls, 'remedy', ''))} |")
    return rows


def _shim_classes(root: type, known: list[type]) -> tuple[list[type], list[str]]:
    """TorchLensError subclasses the shims define, and the shims that failed to import."""
    failed = []
    for name in SHIM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the page says which shim could not be read
            failed.append(f"{name} ({type(exc).__name__})")
    found: list[type] = []
    stack = list(root.__subclasses__())
    while stack:
        cls = stack.pop(0)
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("torchlens_shims") and cls not in found and cls not in known:
            found.append(cls)
    return found, failed


def _family_order(classes: list[type], root: type) -> list[type]:
    """Depth first from the root, so each family is followed by its members."""
    wanted = set(classes)
    ordered: list[type] = []

    def visit(cls: type) -> None:
        if cls in wanted and cls not in ordered:
            ordered.append(cls)
        for sub in cls.__subclasses__():
            visit(sub)

    visit(root)
    return ordered + [c for c in classes if c not in ordered]


def render(include_shims: bool = True) -> str:
    """The generated part of the errors page (Markdown).

    Args:
        include_shims: also import the shims and list the errors they add. Importing the
            nnsight shim changes global state (it mounts ``.save`` on objects), so tests
            running inside a shared interpreter pass False.
    """
    from torchlens.errors import TorchLensError, all_error_classes

    classes = _family_order(all_error_classes(), TorchLensError)
    lines = ["## Every error at a glance", ""]
    lines += _table(classes, TorchLensError)
    lines += ["", "## Details", ""]
    for cls in classes:
        lines += _section(cls, TorchLensError)
    shims, failed = _shim_classes(TorchLensError, classes) if include_shims else ([], [])
    if shims or failed:
        lines += ["## Errors the shims add", "",
                  "The nnsight and baukit shims raise the errors above, plus these, which keep the "
                  "name and meaning the original library gives them.", ""]
        for cls in shims:
            lines += _section(cls, TorchLensError)
        for name in failed:
            lines += [f"!!! warning \"{name} could not be imported while building this page\"", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """mkdocs event: replace the marker on the errors page with the generated reference."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        log.warning("%s has no %s marker; the error reference was not generated", PAGE, MARKER)
        return markdown
    return markdown.replace(MARKER, render())
