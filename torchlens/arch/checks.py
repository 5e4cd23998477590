"""Canonical sites checked against the structure they claim, on the recorded forward.

An inferred layout (the generic adapter) is a claim about a model no one declared; these checks
hold it to the values the forward computed:

* ``resid_mid`` (:class:`CheckedResidualAdd`): the block's first own add must equal
  ``resid_pre + attn_out`` exactly (a pre-norm block: ``h = x + attn(norm(x))``). A block whose
  first add is something else (a parallel block adds attention and MLP together, a post-norm
  block normalises the sum) fails, and reading the site raises ``LayoutInferenceError`` saying so.
* the chain (:func:`check_layout`): ``resid_post[L]`` is ``resid_pre[L+1]``, and each offered
  ``resid_mid`` holds its identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core.records import ModuleCall, Op
from ..core.selectors import ModuleOutput
from ..errors import LayoutInferenceError, TorchLensError
from .views import ArchView, BlockOp, _hidden_input

if TYPE_CHECKING:
    from ..core.trace import Trace

__all__ = ["CheckedOutput", "CheckedResidualAdd", "check_layout"]


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _recorded(op: Op) -> Any:
    """The value an op computed when the forward ran (a fork's edits are not the structure's claim)."""
    return op.out if op.saved else None


def _call_output(trace: Trace, call: ModuleCall) -> torch.Tensor | None:
    """A module call's first output tensor as recorded, read from the op that produced it."""
    ref = next((r for r in call.out_refs if r is not None), None)
    value = None if ref is None else _recorded(trace.ops[ref.index])
    if value is None:
        return None
    return _first_tensor(value[ref.elem] if ref.elem is not None else value)


class CheckedResidualAdd(BlockOp):
    """``resid_mid`` of an inferred pre-norm block: the block's first own add, offered only where
    its value is ``resid_pre + attn_out`` exactly on the recorded forward."""

    def __init__(self, block: str, attn: str, mlp: str | None = None, pass_index: int | None = None,
                 name: str = "") -> None:
        super().__init__(block, ("add",), 1, pass_index, name or f"resid_mid of {block}")
        self.attn = attn
        self.mlp = mlp

    def at_pass(self, pass_index: int) -> CheckedResidualAdd:
        return CheckedResidualAdd(self.block, self.attn, self.mlp, pass_index, self.name)

    def failure(self, trace: Trace, op: Op) -> str | None:
        """Why ``op`` is not the residual stream between attention and MLP of its block call, or None.

        Checks, on recorded values: (1) ``op == resid_pre + attn_out``; (2) the MLP had not run
        before it (else the block is parallel: the MLP does not read it); (3) once the block has
        returned, ``resid_post == op + mlp_out`` (else the block is post-norm: the stream is the
        normalised sum). During capture (3) cannot run yet: the block has not returned.
        """
        calls = trace.calls_of(self.block)
        call = calls[op.module_pass - 1]

        def within(address: str | None) -> list[ModuleCall]:
            return [c for c in trace.calls_of(address) if call.op_start <= c.op_start] if address else []

        attn = next((c for c in within(self.attn) if c.op_start < op.index), None)
        if attn is None:
            return f"{self.attn!r} did not run before the block's first add ({op.label})"
        if any(c.op_start < op.index for c in within(self.mlp)):
            return f"{self.mlp!r} ran before {op.label}: a parallel block, its MLP does not read resid_mid"
        pre = _hidden_input(call.args, call.kwargs)
        got = _first_tensor(_recorded(op))
        attn_outs = self._addends(trace, call, attn, op.index)
        if pre is None or got is None or not attn_outs:
            return ("the values needed to check it (the block's input, the attention output, the add) were not "
                    "saved; capture with save=None")
        if not _sums(got, pre, attn_outs):
            return (f"{op.label} != resid_pre + attn_out (the block is not pre-norm: a parallel or post-norm block "
                    "adds something else first)")
        mlp = next((c for c in within(self.mlp) if c.op_start > op.index), None)
        post = _call_output(trace, call) if call.out_refs else None
        if mlp is not None and post is not None:
            if not _sums(post, got, self._addends(trace, call, mlp, call.op_end)):
                return (f"resid_post != {op.label} + mlp_out (the block does more than add the MLP's output: a "
                        "post-norm block normalises the sum, others scale it or add further terms)")
        return None

    def _addends(self, trace: Trace, call: ModuleCall, sublayer: ModuleCall, before: int) -> list[torch.Tensor]:
        """What a sublayer adds to the stream: its output, or that output through a norm of the block's own
        that ran after it (a sandwich norm: ``x + post_attention_norm(attn(x))``)."""
        found = [_call_output(trace, sublayer)]
        for address in trace.module_addresses:
            if address.rpartition(".")[0] != self.block:
                continue
            for c in trace.calls_of(address):
                if sublayer.op_end <= c.op_start < before and "norm" in c.module_type.lower():
                    found.append(_call_output(trace, c))
        return [t for t in found if t is not None]

    def _refuse(self, trace: Trace, op: Op) -> None:
        why = self.failure(trace, op)
        if why is not None:
            raise LayoutInferenceError(f"{self.name}: not offered, its structural check failed: {why}",
                                       site=self.name)

    def matches_op(self, op: Op) -> bool:
        if not super().matches_op(op):
            return False
        self._refuse(op.trace, op)
        return True

    def match(self, trace: Trace) -> list[Op | ModuleCall]:
        ops = super().match(trace)
        for op in ops:
            self._refuse(trace, op)
        return ops

    def describe(self) -> str:
        return f"checked_add({self.block!r})"

    __repr__ = describe


class CheckedOutput(ModuleOutput):
    """An inferred sublayer's output (``attn``, ``mixer``, ``mlp``, ``experts``, ``cross_attn``), offered only
    where it writes one stream-sized vector per token: its first tensor has as many elements as its block's
    output (the same pass). A module that is not the sublayer (a gate, a projection to another width) fails."""

    def __init__(self, path: str, block: str, name: str) -> None:
        super().__init__(path)
        self.block = block
        self.name = name

    def match(self, trace: Trace) -> list[Op | ModuleCall]:
        calls = super().match(trace)
        blocks = trace.calls_of(self.block)
        for call in calls:
            if not isinstance(call, ModuleCall) or len(blocks) < call.pass_index:
                continue  # the sublayer runs more often than its block (a shared module): no pairing to check
            out = _first_tensor(trace.module_output(call))
            ref = _first_tensor(trace.module_output(blocks[call.pass_index - 1]))
            if out is not None and ref is not None and out.numel() != ref.numel():
                raise LayoutInferenceError(
                    f"{self.name}: not offered, its structural check failed: {call.key} returned "
                    f"{tuple(out.shape)}, not one vector per token of the stream {tuple(ref.shape)} (the module "
                    "named like this role is not the sublayer whose output joins the residual stream)",
                    site=self.name)
        return calls


def _sums(total: torch.Tensor, base: torch.Tensor, addends: list[torch.Tensor]) -> bool:
    """Whether ``total == base + a`` exactly for one of ``addends`` (reshaped when only the layout differs)."""
    if total.numel() != base.numel():
        return False
    total = total.reshape(base.shape)
    return any(a.numel() == base.numel() and torch.equal(total, base + a.reshape(base.shape)) for a in addends)


def _read(trace: Trace, view: ArchView, name: str) -> torch.Tensor | str:
    """The value of a canonical site in ``trace``, or why it cannot be read."""
    try:
        sites = trace.find_sites(view.selector(name))
        return _first_tensor(sites.first().out)
    except TorchLensError as exc:
        return exc.message


def _n_experts(view: ArchView, name: str) -> int | None:
    """How many experts a block's ``experts`` module holds: its list's length, or a fused weight's first dim."""
    try:
        module = view.module(name)
    except TorchLensError:
        return None
    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        return len(module)
    sizes = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    return sizes.pop() if len(sizes) == 1 else None


def _role_checks(trace: Trace, view: ArchView) -> list[tuple[str, bool, str]]:
    """Sublayers write one d_model vector per token into the stream; a router scores one logit per expert."""
    rows = []
    for i in range(view.n_layers):
        pre = _read(trace, view, f"blocks.{i}.resid_pre")
        if isinstance(pre, str) or pre is None:
            continue
        for kind in ("attn", "mixer", "mlp", "experts"):
            name = f"blocks.{i}.{kind}"
            if name not in view.names():
                continue
            what = f"{name} has resid_pre's size ({pre.numel()})"
            try:
                out = _first_tensor(trace.find_sites(view.selector(name)).first().out)
            except LayoutInferenceError as exc:  # its own check refused it on read
                rows.append((what, False, exc.message))
                continue
            except TorchLensError:
                continue  # a sublayer that did not run here (cross-attention without encoder states)
            if out is not None:
                rows.append((what, out.numel() == pre.numel(),
                             "" if out.numel() == pre.numel() else f"{tuple(out.shape)} vs {tuple(pre.shape)}"))
        name = f"blocks.{i}.router"
        if name in view.names():
            logits, n = _read(trace, view, name), _n_experts(view, f"blocks.{i}.experts")
            if not isinstance(logits, str) and logits is not None and n:
                holds = logits.shape[-1] == n
                rows.append((f"{name} scores each token over the {n} experts", holds,
                             "" if holds else f"router output {tuple(logits.shape)}"))
    return rows


def check_layout(trace: Trace, view: ArchView) -> list[tuple[str, bool, str]]:
    """Structural checks of ``view``'s block sites on a recorded forward.

    Returns:
        rows ``(identity, holds, detail)``: ``blocks.L.resid_post == blocks.{L+1}.resid_pre`` for
        each adjacent pair; each offered attn / mixer / mlp / experts output has resid_pre's size; each
        router scores every token over the block's experts; ``blocks.L.resid_mid == resid_pre + attn``
        where resid_mid is offered.
    """
    rows: list[tuple[str, bool, str]] = []
    for i in range(view.n_layers - 1):
        post, pre = _read(trace, view, f"blocks.{i}.resid_post"), _read(trace, view, f"blocks.{i + 1}.resid_pre")
        what = f"blocks.{i}.resid_post == blocks.{i + 1}.resid_pre"
        if isinstance(post, str) or isinstance(pre, str):
            rows.append((what, False, post if isinstance(post, str) else pre))
        else:
            rows.append((what, bool(torch.equal(post, pre)), ""))
    rows += _role_checks(trace, view)
    for name in view.names("resid_mid"):
        i = name.split(".")[1]
        mid, pre, attn = (_read(trace, view, f"blocks.{i}.{k}") for k in ("resid_mid", "resid_pre", "attn"))
        what = f"{name} == blocks.{i}.resid_pre + blocks.{i}.attn"
        bad = next((v for v in (mid, pre, attn) if isinstance(v, str) or v is None), False)
        if isinstance(view.targets[name], CheckedResidualAdd):  # its own checks ran on the read
            rows.append((what + " (checked on read)", not isinstance(mid, str), mid if isinstance(mid, str) else ""))
        elif bad is not False:
            rows.append((what, False, bad or "not a tensor"))
        else:
            rows.append((what, bool(torch.equal(mid, pre + attn)), ""))
    return rows
