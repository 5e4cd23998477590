"""mkdocs hook: the "What is not supported" list of the nnsight page, from the shim's scope file.

``docs/coming-from-nnsight.md`` holds the marker below; at build time it is replaced by the
rows of ``shims/torchlens_shims/nnsight/upstream_scope.tsv`` (nnsight 0.8.1's own tests the
shim counts as out of scope, with the reason), grouped by category. The same file decides
the in-scope score of ``scripts/nnsight_upstream.sh``, so the page cannot drift from it.
"""

from __future__ import annotations

import pathlib
from typing import Any

__all__ = ["on_page_markdown", "render"]

MARKER = "<!-- torchlens:nnsight-out-of-scope -->"
PAGE = "coming-from-nnsight.md"
SCOPE = pathlib.Path(__file__).resolve().parents[1] / "shims" / "torchlens_shims" / "nnsight" / "upstream_scope.tsv"
CATEGORIES = {
    "remote": "NDIF and remote execution (`RemoteUnsupportedError`)",
    "serialization": "Serializing traces for the remote back end (`RemoteUnsupportedError`)",
    "vllm": "vLLM (`VLLMUnsupportedError`)",
    "tensor-parallel": "Tensor parallelism (`TensorParallelUnsupportedError`)",
    "internals": "nnsight's internals (`InternalsUnsupportedError`): no user code observes these",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(path: pathlib.Path = SCOPE) -> str:
    """The Markdown for the scope file: one table per category, in the order above.

    Raises:
        ValueError: a row names a category not listed in ``CATEGORIES``.
    """
    rows: dict[str, list[tuple[str, str]]] = {key: [] for key in CATEGORIES}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pattern, category, reason = line.split("\t")
        if category not in rows:
            raise ValueError(f"{path.name}: unknown category {category!r} (known: {', '.join(CATEGORIES)})")
        rows[category].append((pattern, reason))
    out = []
    for category, title in CATEGORIES.items():
        out += [f"**{title}**", "", "| nnsight 0.8.1 tests | why |", "|---|---|"]
        out += [f"| `{pattern}` | {_cell(reason)} |" for pattern, reason in rows[category]]
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Replace the marker on the nnsight page with the rendered list."""
    if page.file.src_path != PAGE or MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
