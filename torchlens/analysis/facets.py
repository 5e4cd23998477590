"""Attention facets: per-head scores, pattern and head outputs, as read-only views.

Models in transformers 5 run attention through ``F.scaled_dot_product_attention``: one
fused op, so the scores and the pattern never exist as tensors. This plugin rebuilds
them from what the capture recorded anyway (the op's q, k, v, mask, scale, causal flag
and grouped-query layout), only when someone reads ``site.facets``: a trace whose facets
are never read pays nothing. Eager-attention models get the same facets, read straight
from their ``softmax`` and ``matmul`` ops, so code reading ``blocks.{i}.attn`` facets does
not care how the model was loaded.

Facets are reconstructions; writing to them would change nothing in the model, so every
write raises ``FacetReadOnlyError`` (edit heads with ``torchlens.mechinterp.patch_head``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..arch.resolve import arch_view
from ..core.actions import provide_methods
from ..core.records import ModuleCall, Op, build_args
from ..core.sites import Site
from ..core.tree import first_tensor
from ..errors import AmbiguousSiteError, FacetReadOnlyError, FusedKernelError, ValueNotSavedError
from ..hookspecs import hookimpl
from ..plugins import facets_for

SDPA = "scaled_dot_product_attention"
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
# Ops an eager attention puts between its softmax and the matmul with v.
_PASSTHROUGH = frozenset({"to", "type", "float", "half", "bfloat16", "dropout", "contiguous", "clone"})
_MATMULS = frozenset({"matmul", "bmm", "einsum"})
# Ops that only rearrange the merged head outputs on their way to the output projection.
_LAYOUT = frozenset({"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "clone",
                     "to", "type"})
_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream"})


# -- read-only tensors ----------------------------------------------------------------------


class ReadOnlyTensor(torch.Tensor):
    """A facet tensor: reads behave like a plain tensor (and return plain tensors), writes raise.

    It shares memory with recorded activations, so an in-place write would silently corrupt
    the trace while leaving the model untouched; ``.clone()`` gives a writable copy.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")
                                              and name not in _NOT_WRITES)
        if (writes and args and isinstance(args[0], ReadOnlyTensor)) or isinstance(kwargs.get("out"),
                                                                                     ReadOnlyTensor):
            raise FacetReadOnlyError(
                f"facet tensors are read-only reconstructions; {name}() would not change the model",
                remedy="Edit a head with torchlens.mechinterp.patch_head(trace, layer, head, what='pattern' "
                "or 'output'); for a writable copy, call .clone().",
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:  # a copy is an ordinary, writable tensor
        return self.as_subclass(torch.Tensor).clone()

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled / torch.save'd as a plain tensor
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def read_only(t: torch.Tensor) -> ReadOnlyTensor:
    return t.as_subclass(ReadOnlyTensor)


# -- reading the recorded arguments of an op ----------------------------------------------------


def recorded_call(trace: Any, op: Op) -> tuple[tuple, dict]:
    """The op's arguments as this trace (or fork) sees them: recorded tensors are replaced by
    their producers' values, so snapshots and a fork's upstream edits are respected."""
    if op.args is None:  # save= dropped the raw arguments: rebuild them from the graph
        trace.ensure_graph()
        return build_args(op, lambda r: trace.seen_value(r, op.index))

    def resolve(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            ref = trace.producer_ref(x, op.index)
            return x if ref is None else trace.seen_value(ref, op.index)
        if type(x) in (list, tuple):
            return type(x)(resolve(y) for y in x)
        return x

    return tuple(resolve(a) for a in op.args), {k: resolve(v) for k, v in op.kwargs.items()}


def sdpa_arguments(trace: Any, op: Op) -> dict[str, Any]:
    """The SDPA call of ``op`` bound to parameter names, defaults filled in."""
    args, kwargs = recorded_call(trace, op)
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, args))
    bound.update(kwargs)
    return bound


# -- the reconstruction itself --------------------------------------------------------------------


def expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat kv heads for grouped-query attention the way the kernel does (head h reads kv
    head ``h // (n_heads // n_kv_heads)``)."""
    n_kv = t.size(-3)
    if n_kv == n_heads:
        return t
    return t.repeat_interleave(n_heads // n_kv, dim=-3)


def attention_scores(q: torch.Tensor, k: torch.Tensor, attn_mask: Any, is_causal: bool,
                     scale: float | None) -> torch.Tensor:
    """``scale * q @ k^T`` plus the mask, as the kernel computes it; masked positions are -inf.

    Low-precision inputs are scored in float32 (what eager implementations do in softmax).
    """
    work = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    q, k = q.to(work), expand_kv(k, q.size(-3)).to(work)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    n_q, n_k = scores.shape[-2:]
    if is_causal:  # top-left aligned, as F.scaled_dot_product_attention defines it
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(work)
    return scores


def attention_pattern(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys; a row with every key masked attends nowhere (zeros), as the kernel's
    math path does, instead of NaN."""
    pattern = torch.softmax(scores, dim=-1)
    if scores.isneginf().all(dim=-1).any():
        pattern = pattern.nan_to_num(0.0)
    return pattern


# -- facet objects ---------------------------------------------------------------------------------


class _Facets:
    """Shared shape of attention facets; attributes are computed on first read and cached."""

    kind = "attention"

    def __init__(self, trace: Any, label: str) -> None:
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name: str, value: Any) -> None:
        raise FacetReadOnlyError(
            f"cannot set {name!r} on the facets of {self.label}: facets are read-only reconstructions",
            site=self.label,
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def _cached(self, key: str, compute) -> Any:
        cache = self._cache
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    @property
    def n_heads(self) -> int:
        return int(self.pattern.shape[-3])

    def kv_head(self, head: int) -> int:
        """The key/value head that query head ``head`` reads (grouped-query layouts)."""
        return head // (self.n_heads // self.n_kv_heads)

    def target(self, what: str) -> str:
        """The op label an edit of ``what`` ('output', 'pattern', 'scores') lands on."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}: {self.n_heads} heads>"


class FusedAttentionFacets(_Facets):
    """Facets of one ``scaled_dot_product_attention`` op, rebuilt from its recorded inputs.

    ``scores`` and ``pattern`` are [batch, heads, q, k]; ``head_out`` is [batch, heads, q,
    head_dim], each head's output before the output projection (the op's own output).
    """

    kind = "fused"

    def __init__(self, trace: Any, op: Op) -> None:
        super().__init__(trace, op.label)
        object.__setattr__(self, "op", op)

    def _args(self) -> dict[str, Any]:
        return self._cached("args", lambda: sdpa_arguments(self._trace, self.op))

    @property
    def q(self) -> ReadOnlyTensor:
        return read_only(self._args()["query"])

    @property
    def k(self) -> ReadOnlyTensor:
        """Keys as the kernel received them (kv-head layout for grouped-query attention)."""
        return read_only(self._args()["key"])

    @property
    def v(self) -> ReadOnlyTensor:
        return read_only(self._args()["value"])

    @property
    def attn_mask(self) -> ReadOnlyTensor | None:
        mask = self._args()["attn_mask"]
        return None if mask is None else read_only(mask)

    @property
    def is_causal(self) -> bool:
        return bool(self._args()["is_causal"])

    @property
    def dropout_p(self) -> float:
        return float(self._args()["dropout_p"])

    @property
    def scale(self) -> float:
        s = self._args()["scale"]
        return 1.0 / math.sqrt(self._args()["query"].size(-1)) if s is None else float(s)

    @property
    def n_heads(self) -> int:
        return int(self._args()["query"].size(-3))

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads of the model: the adapter's ``n_kv_heads`` (``tl.arch``) when one
        serves the model, else as the kernel received them. Some models repeat their kv
        heads before the kernel (Llama with a padding mask); the reconstruction follows the
        recorded layout either way, this only names the grouping."""
        return self._cached("n_kv_heads", self._n_kv_heads)

    def _n_kv_heads(self) -> int:
        recorded = int(self._args()["key"].size(-3))
        n_heads = self.n_heads
        declared = _adapter_kv_heads(self._trace)
        if declared and n_heads % declared == 0 and recorded in (declared, n_heads):
            return declared
        return recorded

    @property
    def head_dim(self) -> int:
        return int(self._args()["query"].size(-1))

    @property
    def scores(self) -> ReadOnlyTensor:
        """Pre-softmax scores ``scale * q @ k^T + mask`` [batch, heads, q, k]; masked: -inf."""
        a = self._args()
        return read_only(self._cached(
            "scores", lambda: attention_scores(a["query"], a["key"], a["attn_mask"], a["is_causal"], a["scale"])
        ))

    @property
    def pattern(self) -> ReadOnlyTensor:
        """Attention weights [batch, heads, q, k]: what ``output_attentions=True`` gives on an
        eager model (before dropout)."""
        q = self._args()["query"]
        return read_only(self._cached("pattern", lambda: attention_pattern(self.scores).to(q.dtype)))

    @property
    def head_out(self) -> ReadOnlyTensor:
        """Per-head outputs [batch, heads, q, head_dim]: ``pattern @ v`` for every head."""

        def compute() -> torch.Tensor:
            try:
                return self._trace.value(self.op.index)
            except ValueNotSavedError:  # the op's output was not kept: recompute it
                v = expand_kv(self._args()["value"], self.n_heads)
                return torch.matmul(self.pattern.as_subclass(torch.Tensor).to(v.dtype), v)

        return read_only(self._cached("head_out", compute))

    def target(self, what: str) -> str:
        if what in ("output", "pattern"):
            return self.op.label
        raise FusedKernelError(
            f"{self.op.label} is a fused scaled_dot_product_attention op: its {what} exist only inside the "
            "kernel, so they cannot be edited",
            site=self.op.label,
        )


class EagerAttentionFacets(_Facets):
    """Facets of an eager attention: views of its real ``softmax`` / ``matmul`` ops."""

    kind = "eager"

    def __init__(self, trace: Any, softmax: Op, pattern_op: Op, matmul: Op) -> None:
        super().__init__(trace, softmax.label)
        object.__setattr__(self, "softmax_op", softmax)
        object.__setattr__(self, "pattern_op", pattern_op)
        object.__setattr__(self, "matmul_op", matmul)

    @property
    def scores_op(self) -> Op | None:
        refs = [r for r in self.softmax_op.parent_refs or () if r is not None]
        return self._trace.ops[refs[0].index] if refs else None

    @property
    def scores(self) -> ReadOnlyTensor:
        op = self.scores_op
        if op is None:
            raise ValueNotSavedError(f"the input of {self.softmax_op.label} was not recorded",
                                     site=self.softmax_op.label)
        return read_only(self._trace.value(op.index))

    @property
    def pattern(self) -> ReadOnlyTensor:
        return read_only(self._trace.value(self.pattern_op.index))

    @property
    def head_out(self) -> ReadOnlyTensor:
        return read_only(self._trace.value(self.matmul_op.index))

    @property
    def n_heads(self) -> int:
        return int(self.pattern_op.shape[-3])

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # eager implementations repeat kv heads before the matmul

    def target(self, what: str) -> str:
        if what == "output":
            return self.matmul_op.label
        if what == "pattern":
            return self.pattern_op.label
        op = self.scores_op
        if what == "scores" and op is not None:
            return op.label
        raise FusedKernelError(f"no recorded op holds the {what} of {self.label}", site=self.label)


def _adapter_kv_heads(trace: Any) -> int | None:
    """``n_kv_heads`` from the architecture adapter serving the trace's model, if any."""
    model = getattr(trace, "model", None)
    if model is None:
        return None
    try:
        value = arch_view(model).n_kv_heads
    except Exception:  # noqa: BLE001 - no adapter (or no arch support): use the recorded layout
        return None
    return value if isinstance(value, int) and value > 0 else None


# -- finding attention in a trace -----------------------------------------------------------------


def _eager_unit(trace: Any, softmax: Op) -> tuple[Op, Op] | None:
    """Follow a 4-D softmax through casts/dropout to the matmul that applies it to v."""
    if not softmax.saved or len(softmax.shape or ()) != 4:
        return None
    trace.ensure_graph()
    ops = trace.ops
    cur = softmax
    for _ in range(6):
        children = [ops[i] for i in cur.children_idx]
        for child in children:
            if child.func_name in _MATMULS:
                first = child.parent_refs[0] if child.parent_refs else None
                if first is not None and first.index == cur.index:
                    return cur, child
        nxt = [c for c in children if c.func_name in _PASSTHROUGH]
        if len(nxt) != 1:
            return None
        cur = nxt[0]
    return None


def facets_of_op(trace: Any, op: Op) -> _Facets | None:
    if op.func_name == SDPA:
        return FusedAttentionFacets(trace, op)
    if op.func_name == "softmax":
        unit = _eager_unit(trace, op)
        if unit is not None:
            return EagerAttentionFacets(trace, op, *unit)
    return None


def attention_facets(trace: Any, ops: list[Op] | None = None) -> list[_Facets]:
    """Every attention of ``ops`` (default: the whole trace), fused first, in execution order.

    Cheap: only op names are scanned; nothing is computed until a facet attribute is read.
    """
    ops = trace.ops if ops is None else ops
    fused = [FusedAttentionFacets(trace, op) for op in ops if op.func_name == SDPA]
    if fused:
        return fused
    found = []
    for op in ops:
        if op.func_name == "softmax":
            f = facets_of_op(trace, op)
            if f is not None:
                found.append(f)
    return found


def _attention_feeding(trace: Any, call: ModuleCall) -> _Facets | None:
    """The attention whose merged head outputs are this module's input (an output
    projection: GPT-2's ``c_proj``, Llama's ``o_proj``, BERT's ``attention.output.dense``,
    which is what some adapters name ``blocks.{i}.attn``). Only layout ops (reshape,
    transpose ...) may lie between them, so an MLP after the residual add does not qualify."""
    tensor = first_tensor((call.args, call.kwargs))
    ref = trace.producer_ref(tensor, call.op_start) if tensor is not None else None
    if ref is None or ref.elem is not None:
        return None
    trace.ensure_graph()
    op = trace.ops[ref.index]
    for _ in range(12):
        if op.func_name == SDPA:
            return FusedAttentionFacets(trace, op)
        if op.func_name in _MATMULS:  # eager: the matmul of pattern and v
            first = op.parent_refs[0] if op.parent_refs else None
            cur = trace.ops[first.index] if first is not None else None
            while cur is not None and cur.func_name in _PASSTHROUGH and cur.parent_refs:
                cur = trace.ops[cur.parent_refs[0].index]
            return facets_of_op(trace, cur) if cur is not None and cur.func_name == "softmax" else None
        if op.func_name not in _LAYOUT or not op.parent_refs:
            return None
        op = trace.ops[op.parent_refs[0].index]
    return None


def facets_of_call(trace: Any, call: ModuleCall) -> _Facets | None:
    found = attention_facets(trace, trace.ops[call.op_start:call.op_end])
    if not found:
        return _attention_feeding(trace, call)
    if len(found) > 1:
        raise AmbiguousSiteError(
            f"module {call.key} runs {len(found)} attention ops ({[f.label for f in found][:8]}); "
            "facets belong to one attention",
            site=call.key,
            candidates=[f.label for f in found],
            remedy="Read the facets of one attention module (e.g. 'blocks.0.attn') or one op label.",
        )
    return found[0] if found else None


def facets_for_site(site: Any) -> _Facets | None:
    record = site.record
    if isinstance(record, Op):
        return facets_of_op(site.trace, record)
    if isinstance(record, ModuleCall):
        return facets_of_call(site.trace, record)
    return None


class FacetPlugin:
    """The built-in facet plugin (registered in code: ``torchlens.plugins.BUILTIN_PLUGINS``)."""

    @staticmethod
    @hookimpl
    def torchlens_facets(site):
        try:
            return facets_for_site(site)
        except AmbiguousSiteError:  # e.g. the whole model: not one attention, so not ours
            return None

@provide_methods(Site)
class FacetsProperty:
    """``Site.facets``, provided by ``analysis/`` (see ``torchlens.core.actions``)."""

    @property
    def facets(self: Site) -> Any:
        """Derived read-only views of this site (e.g. attention pattern), from facet plugins.

        Raises:
            SiteNotFoundError: no facet plugin understands this site.
        """
        return facets_for(self)


__all__ = [
    "EagerAttentionFacets",
    "FacetPlugin",
    "FacetsProperty",
    "FusedAttentionFacets",
    "ReadOnlyTensor",
    "attention_facets",
    "attention_pattern",
    "attention_scores",
    "expand_kv",
    "sdpa_arguments",
]
