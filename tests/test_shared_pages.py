"""Forks build big values on pages shared with the recorded tensor (copy-on-write).

Checked against ``clone()`` (bit for bit), against a plain-hook re-execution of the edit, and
through ``/proc/self/maps`` that the fork's tensor really lies in the shared file's mapping.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from conftest import edited_forward
from torch import nn

import torchlens as tl
from torchlens.edit._regions import RowPatch
from torchlens.edit._shared_pages import MIN_BYTES, page_copy

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="copy-on-write copies need memfd (Linux)")

NAME = "torchlens-recorded"


def _mapped_files(tensor: torch.Tensor) -> list[str]:
    """The names of the mappings ``tensor``'s first byte lies in (``/proc/self/maps``)."""
    at = tensor.data_ptr()
    names = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= at < hi:
                names.append(" ".join(parts[5:]))
    return names


def _open_files() -> int:
    return sum(NAME in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def _big(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, MIN_BYTES // 4 // 64 + 7, generator=torch.Generator().manual_seed(seed))


def test_copy_equals_clone_bit_for_bit_and_writes_stay_private():
    base = _big()
    want = base.clone()
    a, b = page_copy(base), page_copy(base)
    assert a is not None and b is not None
    assert a.shape == base.shape and a.dtype == base.dtype and a.data_ptr() != base.data_ptr()
    assert torch.equal(a.view(torch.int32), want.view(torch.int32))
    assert any(NAME in n for n in _mapped_files(a))
    a[-1] = 7.0
    a[0, 0] = -1.0
    assert torch.equal(base, want) and torch.equal(b, want)
    assert bool((a[-1] == 7.0).all()) and torch.equal(a[1:-1], want[1:-1])


def test_an_in_place_write_to_the_base_makes_a_new_shared_copy():
    base = _big()
    before = page_copy(base)
    base[3] += 1.0
    after = page_copy(base)
    assert torch.equal(after, base)
    assert not torch.equal(before[3], base[3]) and torch.equal(before[4:], base[4:])


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 8),  # small: a clone is as fast
    lambda: _big().t(),  # strided
    lambda: _big().requires_grad_(),  # tracked by autograd
])
def test_where_it_does_not_apply_it_says_so(make):
    assert page_copy(make()) is None


def test_the_shared_file_closes_when_the_recorded_tensor_dies():
    gc.collect()
    before = _open_files()
    base = _big()
    copy = page_copy(base)
    more = [page_copy(base) for _ in range(20)]  # each copy is a mapping, holding no descriptor
    assert _open_files() == before + 1
    del more
    del base
    gc.collect()
    assert _open_files() == before
    assert copy.sum().isfinite()  # the fork's mapping outlives the file descriptor


def test_row_patch_built_on_shared_pages_equals_the_cloned_build():
    base = _big()
    rows = torch.randn(1, base.shape[1], generator=torch.Generator().manual_seed(3))
    built = RowPatch(base, 0, 63, rows).resolve()
    want = base.clone()
    want[63:] = rows
    assert torch.equal(built, want) and any(NAME in n for n in _mapped_files(built))
    half = RowPatch(base, 0, 10, torch.zeros(54, base.shape[1])).resolve()  # most rows new: cloned
    assert not any(NAME in n for n in _mapped_files(half)) and bool((half[10:] == 0).all())


class _WideHead(nn.Module):
    """Position-wise layers then a wide head: outputs of 1 x 64 x 20000 (5 MB) floats."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20_000)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


def _zero_last(out):
    out = out.clone()
    out[:, -1] = 0
    return out


def test_forks_of_a_wide_output_equal_a_hooked_forward_and_stay_independent():
    model = _WideHead().eval()
    x = torch.randn(1, 64, 8, generator=torch.Generator().manual_seed(2))
    trace = tl.trace(model, x)
    recorded = trace.output.clone()
    want = edited_forward(model, "inner", _zero_last, (x,))
    forks = [trace.fork().do(tl.module("inner"), _zero_last) for _ in range(3)]
    outs = [f.output for f in forks]
    for out in outs:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        assert any(NAME in n for n in _mapped_files(out))
    outs[0][:, :5] = 1.0  # a write to one fork's value reaches neither the trace nor another fork
    assert torch.equal(trace.output, recorded) and torch.equal(outs[1], outs[2])
    torch.testing.assert_close(outs[1], want, atol=1e-6, rtol=1e-6)
