"""Splicing a computation into a module's output while the recorder records it as the model's own ops.

A *splice* is a capture-time edit whose own ops are recorded (a feature dictionary's encode and
decode at a site: ``tl.trace(model, x, features={site: sae})``): it runs inside the site's module
call, its ops become ordinary ops of the trace (read, edited and replayed like any other), and it
names the ops that are sub-sites (``<site>.features``). The splice object has a method
``splice(value, tools) -> new value``; ``tools`` is a :class:`SpliceTools`, the one way it reaches the
recorder.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..core.records import Op

__all__ = ["SUB_SITE", "SUB_SITE_PARTS", "SpliceTools", "sub_site_label"]

# The sub-sites a splice names (a feature dictionary's: ``torchlens.dictionaries.attach``), and how a
# site string addressing one looks: ``<module site>.<part>``, optionally ``:N`` for the module's pass N.
SUB_SITE_PARTS = ("features", "recon", "recon_clean", "error")
SUB_SITE = re.compile(r"^(?P<site>.+)\.(?P<part>" + "|".join(SUB_SITE_PARTS) + r")(?::(?P<pass>\d+))?$")


def sub_site_label(address: str, pass_index: int, part: str) -> str:
    """The label of a sub-site of a module call: ``addr.part`` (first pass) or ``addr.part:N``."""
    return f"{address}.{part}" if pass_index in (None, 1) else f"{address}.{part}:{pass_index}"


class SpliceTools:
    """What a splice may ask of the recorder recording it: name sub-site ops, record opaque ops."""

    def __init__(self, recorder: Any, call: Any) -> None:
        self.recorder = recorder
        self.call = call
        self.start = len(recorder.ops) + len(recorder.pending)  # ops from here on are the splice's

    def label(self, part: str) -> str:
        return sub_site_label(self.call.address, self.call.pass_index, part)

    def name(self, tensor: torch.Tensor, part: str) -> torch.Tensor:
        """Name the op that produced ``tensor`` ``<site>.<part>``; a tensor no op of the splice produced
        (the input handed back, a parameter) is first copied by a recorded ``clone``, so the name never
        moves a model op's label. Returns the tensor the name is on."""
        rec = self.recorder
        rec.flush()
        ref = rec.build.producer_ref(tensor, len(rec.ops))
        if ref is None or ref.index < self.start or ref.elem is not None:
            tensor = tensor.clone()  # recorded: the splice's own op
            rec.flush()
            ref = rec.build.producer_ref(tensor, len(rec.ops))
        op = rec.ops[ref.index]
        steps = rec.op_steps
        before = [w.site.matches_op(op) for w in steps]  # steps matching its numbered label took it already
        rec.build.relabel(ref.index, self.label(part))
        self._keep_if_saved(ref.index)
        for when, seen in zip(steps, before):  # capture-time edits of the sub-site (tl.when(site.features, ...))
            if not seen and when.site.matches_op(op):
                tensor = rec._edit_op(when, tensor, op.module, op.module_pass, op.label, op)
        return tensor

    def unrecorded(self, func: Any, *args: Any) -> Any:
        """``func(*args)`` with the recorder paused: a value the splice needs that is no op of the trace."""
        rec = self.recorder
        rec.flush()
        rec.paused = True
        try:
            return func(*args)
        finally:
            rec.paused = False

    def opaque(self, func: Any, args: tuple, value: torch.Tensor, part: str) -> torch.Tensor:
        """Record one op ``<site>.<part>`` computing ``func(*args)``, whose value is ``value`` (computed
        already by the splice, never a second time); replay re-runs ``func`` when an argument changed.
        Returns a new tensor object over ``value``'s memory, detached from autograd (gradients do not flow
        through an op the splice did not compute), the op's output."""
        rec = self.recorder
        rec.flush()
        rec.paused = True
        try:
            out = value.detach()  # one object per op: producers are found by identity
        finally:
            rec.paused = False
        build = rec.build
        index = len(rec.ops)
        op = Op(index, self.label(part), func, getattr(func, "__name__", part), out, self.call.address,
                self.call.pass_index, None, 0, tuple(args), {}, 0)
        build.add_op(op)
        if rec.transient:
            build.link_args(op)
        build.register_tensor(out, index, None)
        self._keep_if_saved(index)
        return out

    def _keep_if_saved(self, index: int) -> None:
        rec = self.recorder
        if rec.save is not None and rec.save.matches_op(rec.ops[index]):
            rec._keep(index)
