"""Notebook HTML, summary, DOT and progress overhead on a 10,000-op trace (issue 16).

Prints one JSON line per case (see ../shared/bench-spec.md): ``ms`` is the median time of the
presentation call, ``base_ms`` a plain forward of the same model; the issue's budget is the
absolute figure (a 10,000-op trace's HTML in under a second), so the note repeats it in seconds.
``ok`` checks the output has one row per op (HTML capped at notebook.MAX_ROWS rows, by design).

    python bench/bench_notebook.py [--quick]
"""

from __future__ import annotations

import torch
from common import emit, emit_rss, measure, plain_forward, setup
from torch import nn

import torchlens as tl
from torchlens.analysis.notebook import MAX_ROWS

__all__ = ["Loop", "main"]


class Loop(nn.Module):
    """A 64-wide residual MLP cell applied ``steps`` times: two ops per step (linear, tanh) + one add."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.cell = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = x + torch.tanh(self.cell(x))
        return x


def main() -> None:
    setup()
    model = Loop(3334).eval()  # 3 ops per step: 10,002 ops + the input
    x = torch.randn(4, 64)
    trace = tl.trace(model, x)
    n = len(trace.ops)
    base = plain_forward(model, x)
    cases = {
        "html_10k_ops": (trace._repr_html_, lambda out: out.count("<tr><td>") == min(n, MAX_ROWS)),
        "summary_10k_ops": (lambda: str(trace.summary()), lambda out: out.count("cell") >= 3334),
        "to_dot_10k_ops": (lambda: trace.to_dot(), lambda out: out.startswith("digraph")),
        "fork_html_10k_ops": (trace.fork("f").do("cell:3000", tl.zero_ablate())._repr_html_,
                              lambda out: "1 edit(s)" in out),
    }
    for case, (fn, check) in cases.items():
        ms, base_ms, ratio = measure(fn, base)
        emit("torchlens", case, ms, base_ms, bool(check(fn())), note=f"{n} ops: {ms / 1000:.3f} s", ratio=ratio)
    emit_rss("torchlens")


if __name__ == "__main__":
    main()
