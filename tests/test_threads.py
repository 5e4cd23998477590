"""Captures are thread-safe: overlapping captures in two threads each get their own trace.

A ``threading.Barrier`` inside the forward (a plain forward hook that waits) forces both
captures to be in the middle of their forward at the same moment; each trace is then
compared by value with a plain single-threaded hook read of the same input.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from conftest import assert_equal_tree, assert_model_clean, hook_reads, hook_state

import torchlens as tl

TIMEOUT = 60


def _with_barrier(model: torch.nn.Module, address: str, barrier: threading.Barrier):
    """A plain hook that parks the forward at ``address`` until every thread got there."""
    def wait(*_: Any) -> None:
        barrier.wait(TIMEOUT)

    return model.get_submodule(address).register_forward_hook(wait)


def _run_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a capture thread hung"
    if errors:
        raise errors[0]
    return results


def _check_trace(trace, model, args, kwargs=None) -> None:
    reads, out = hook_reads(model, args, kwargs)
    for address, outs in reads.items():
        for i, want in enumerate(outs):
            key = address if len(outs) == 1 else f"{address}:{i + 1}"
            assert_equal_tree(trace[key].out, want, what=key)
    assert_equal_tree(trace.output, out)


def test_two_threads_trace_two_different_models_at_once(tiny_gpt2, cnn):
    barrier = threading.Barrier(2)
    handles = [_with_barrier(tiny_gpt2.model, "transformer.h.0", barrier), _with_barrier(cnn.model, "bn1", barrier)]
    try:
        before = [hook_state(tiny_gpt2.model), hook_state(cnn.model)]
        gpt_trace, cnn_trace = _run_threads([
            lambda: tl.trace(tiny_gpt2.model, *tiny_gpt2.args),
            lambda: tl.trace(cnn.model, *cnn.args),
        ])
        assert_model_clean(tiny_gpt2.model, before[0])
        assert_model_clean(cnn.model, before[1])
    finally:
        for h in handles:
            h.remove()
    assert barrier.n_waiting == 0 and not barrier.broken
    _check_trace(gpt_trace, tiny_gpt2.model, tiny_gpt2.args)
    _check_trace(cnn_trace, cnn.model, cnn.args)
    # neither trace picked up the other model's ops
    assert all(not op.module.startswith(("conv", "bn")) for op in gpt_trace.ops)
    assert all(not op.module.startswith("transformer") for op in cnn_trace.ops)


def test_two_threads_trace_the_same_model_with_different_inputs(tiny_gpt2):
    model = tiny_gpt2.model
    ids_a = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ids_b = torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2]])
    barrier = threading.Barrier(2)
    handle = _with_barrier(model, "transformer.h.1.mlp", barrier)
    try:
        before = hook_state(model)
        trace_a, trace_b = _run_threads([lambda: tl.trace(model, ids_a), lambda: tl.trace(model, ids_b)])
        assert_model_clean(model, before)
    finally:
        handle.remove()
    assert len(trace_a.ops) == len(trace_b.ops)  # same graph, but each saw only its own calls
    assert len(trace_a.calls) == len(trace_b.calls) == len(hook_reads(model, (ids_a,))[0])
    _check_trace(trace_a, model, (ids_a,))
    _check_trace(trace_b, model, (ids_b,))


def test_two_threads_edit_the_same_model_differently(tiny_gpt2):
    """Capture-time edits from one thread never land in the other thread's forward."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    barrier = threading.Barrier(2)
    handle = _with_barrier(model, "transformer.h.1", barrier)
    try:
        zeroed, scaled = _run_threads([
            lambda: tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.0"), tl.zero_ablate())),
            lambda: tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.0"), tl.scale(3.0))),
        ])
    finally:
        handle.remove()
    from conftest import edited_forward

    want_zero = edited_forward(model, "transformer.h.0", lambda o: torch.zeros_like(o), (ids,))
    want_scale = edited_forward(model, "transformer.h.0", lambda o: o * 3.0, (ids,))
    assert_equal_tree(zeroed.output, want_zero)
    assert_equal_tree(scaled.output, want_scale)
    assert len(zeroed.edits) == len(scaled.edits) == 1


def test_extract_in_two_threads_on_the_same_model(shared_twice):
    model, x = shared_twice.model, shared_twice.args[0]
    x2 = x * -2.0
    barrier = threading.Barrier(2)
    handle = _with_barrier(model, "inp", barrier)
    try:
        a, b = _run_threads([
            lambda: tl.extract(model, x, ["block:1", "block:2", "out"]),
            lambda: tl.extract(model, x2, ["block:1", "block:2", "out"]),
        ])
    finally:
        handle.remove()
    for got, inp in ((a, x), (b, x2)):
        reads, _ = hook_reads(model, (inp,))
        assert torch.equal(got["block:1"], reads["block"][0])
        assert torch.equal(got["block:2"], reads["block"][1])
        assert torch.equal(got["out"], reads["out"][0])


def test_module_reads_in_two_threads_on_the_same_model(tiny_gpt2):
    """Whole-module reads (off hooks, no trace built) in two threads at once: each its own forward's values."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    ids2 = (ids + 3) % model.config.vocab_size
    sites = ["transformer.h.0", "transformer.h.1.mlp", "transformer.ln_f"]
    before = hook_state(model)
    barrier = threading.Barrier(2)
    handle = _with_barrier(model, "transformer.h.1", barrier)
    try:
        a, b = _run_threads([lambda: tl.extract(model, ids, sites), lambda: tl.extract(model, ids2, sites)])
    finally:
        handle.remove()
    assert_model_clean(model, before)
    for got, inp in ((a, ids), (b, ids2)):
        reads, _ = hook_reads(model, (inp,))
        for s in sites:
            assert torch.equal(got[s], reads[s][0]), s
    assert not torch.equal(a["transformer.ln_f"], b["transformer.ln_f"])
