"""``tl.arch(model)``: what an architecture adapter knows about a model, and canonical sites.

Canonical names let one analysis run on GPT-2, Pythia, Llama, Gemma or BERT without knowing
each family's module paths. An adapter (a plugin, see ``torchlens.hookspecs``) maps them,
per family, to one of three kinds of site:

* a module's output — ``blocks.{i}`` / ``blocks.{i}.resid_post`` (the block), ``blocks.{i}.attn``
  (the attention module) and ``blocks.{i}.mlp`` (the MLP, whose output is added to the
  residual stream), ``embed`` (token embedding), ``pos_embed`` (a learned position embedding
  added to the residual stream, where the family has one: GPT-2's ``wpe``), ``unembed`` (the LM head);
* a module's input — ``blocks.{i}.resid_pre``: after capture, the op that produced the
  block's hidden-state input (so a fork's edit reaches every reader of it); during capture,
  the output of the module that produced it (the previous block, or the embedding stage);
  where no module produces it (block 0 reading the model's own input) a capture refuses it
  before the forward, and a fork that must re-execute applies it to the input it passes;
* where a block has them: ``blocks.{i}.mixer`` (a state-space or linear-attention sequence mixer:
  Mamba, RWKV-style and hybrid layers; ``attn`` is refused on such a block, naming ``mixer``),
  ``blocks.{i}.cross_attn`` (an encoder-decoder decoder's attention over the encoder),
  ``blocks.{i}.router`` (an MoE MLP's gate: its first output is the router logits) and
  ``blocks.{i}.experts`` (the routed experts' combined output, before any shared expert);
* an op directly inside a block — ``blocks.{i}.resid_mid``: the residual add between the
  attention and the MLP sublayers. It is an op, not a module output, so it needs the
  function-mode engine (``tl.trace``), which records ops; it works after capture and during it.

``tl.module("blocks.3.mlp")``, ``trace["blocks.3.resid_post"]``, ``tl.when(...)`` and
``tl.extract`` accept these names; the real module paths keep working alongside.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.indices import python_indices
from ..core.names import nearest
from ..core.records import ModuleCall, Op
from ..core.selectors import ModuleOutput, Selector, split_pass
from ..errors import LayoutInferenceError, SiteNotFoundError, TorchLensError
from .infer import block_candidates, infer_block
from .tl_names import TL_HOOK, transformerlens_hint

if TYPE_CHECKING:
    from ..core.trace import Trace

__all__ = [
    "ADAPTER_REMEDY", "CANONICAL", "KINDS", "Absent", "ArchView", "BlockOp", "InputOf", "Layout", "OutputOf",
    "ResidualAdd", "base_prefix", "config_dims", "is_canonical",
]

# the last four are where a block has them: a state-space / linear-attention mixer (Mamba, the linear layers
# of hybrids), cross-attention (encoder-decoder decoders), an MoE MLP's router logits and its experts' output
KINDS = ("attn", "mlp", "resid_pre", "resid_mid", "resid_post", "mixer", "cross_attn", "router", "experts")
CANONICAL = re.compile(r"^(embed|pos_embed|unembed|blocks\.\d+(\.(" + "|".join(KINDS) + r"))?)$")
ADAPTER_REMEDY = (
    "Write an adapter: an object with name, model_types and view(model) -> ArchView (build it with "
    "torchlens.arch.Layout), returned from a torchlens_adapters() hookimpl and registered with "
    "torchlens.plugins.register(...) or an entry point in group 'torchlens'. See docs/plugins.md. "
    "Real module paths (trace.modules) work without any adapter."
)


def is_canonical(name: str) -> bool:
    """Whether ``name`` (without a ``:pass`` suffix) has the shape of a canonical site name."""
    return CANONICAL.match(split_pass(name)[0]) is not None


# -- the non-module canonical sites ---------------------------------------------------------


def _hidden_input(args: Any, kwargs: Any) -> torch.Tensor | None:
    """A block's hidden-state input: its first positional tensor, else ``hidden_states=``."""
    args, kwargs = args or (), kwargs or {}
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for key in ("hidden_states", "x", "input", "inputs_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


def _calls(trace: Trace, address: str, pass_index: int | None, site: str) -> list[ModuleCall]:
    calls = trace.calls_of(address)
    if not calls:
        raise SiteNotFoundError(
            f"{site}: module {address!r} did not run in this trace",
            site=site,
            remedy="Check that the forward ran this block (trace.modules lists the calls).",
        )
    if pass_index is None:
        return list(calls)
    if not 1 <= pass_index <= len(calls):
        raise SiteNotFoundError(
            f"{site}: module {address!r} ran {len(calls)} time(s); there is no pass {pass_index}",
            site=site,
            remedy=f"Use a pass between 1 and {len(calls)}.",
        )
    return [calls[pass_index - 1]]


class InputOf(Selector):
    """The hidden state entering a module (its first tensor argument).

    After capture it resolves to the op that produced that tensor, so editing it on a fork
    changes every reader of the value (the residual branch too), exactly as if the producer
    had computed it. During capture it is served by ``via``, the module whose output *is*
    that tensor (hooks cannot reach a value between two modules otherwise).
    """

    def __init__(self, address: str, via: Selector | None = None, pass_index: int | None = None,
                 name: str = "") -> None:
        self.address = address
        self.via = via
        self.pass_index = pass_index
        self.name = name or f"input of {address}"

    def module_paths(self) -> list[str] | None:
        return self.via.module_paths() if self.via is not None else None

    def matches_op(self, op: Op) -> bool:
        return self.via.matches_op(op) if self.via is not None else False

    def match(self, trace: Trace) -> list[Op | ModuleCall]:
        found: dict[int, Op | ModuleCall] = {}
        for call in _calls(trace, self.address, self.pass_index, self.name):
            tensor = _hidden_input(getattr(call, "args", None), getattr(call, "kwargs", None))
            ref = trace.producer_ref(tensor, call.op_start) if tensor is not None and trace.ops else None
            if ref is None or ref.elem is not None:
                # no op graph (a hooks-engine capture) or the value is one element of a
                # multi-output op: the producing module's output is the same tensor
                if self.via is None:
                    raise SiteNotFoundError(
                        f"{self.name}: the op that produced the input of {self.address!r} was not recorded",
                        site=self.name,
                        remedy="Capture with tl.trace (the function-mode engine records every op).",
                    )
                return self.via.match(trace)
            op = trace.ops[ref.index]
            found.setdefault(id(op), op)
        return list(found.values())

    def capture_refusal(self) -> str | None:
        if self.via is not None:
            return None
        return (f"{self.name} is the model's own input here (no module before {self.address!r} produces it), "
                "and a capture edits what modules and ops produce")

    def describe(self) -> str:
        return f"input_of({self.address!r})"

    __repr__ = describe


class BlockOp(Selector):
    """The ``nth`` call of ``funcs`` made directly in a block (not inside a submodule).

    This is how ``resid_mid`` is found: the first add in a pre-LN block's own code is the
    attention residual add. The rule only looks at ops that already ran, so the same
    selector serves reads after capture and edits during it (function-mode engine).
    """

    def __init__(self, block: str, funcs: Iterable[str] = ("add",), nth: int = 1,
                 pass_index: int | None = None, name: str = "") -> None:
        self.block = block
        self.funcs = frozenset(funcs)
        self.nth = nth
        self.pass_index = pass_index
        self.name = name or f"{block} op {sorted(self.funcs)}#{nth}"

    def _direct(self, op: Op) -> bool:
        return op.module == self.block and op.func_name in self.funcs

    def matches_op(self, op: Op) -> bool:
        if not self._direct(op) or (self.pass_index is not None and op.module_pass != self.pass_index):
            return False
        trace = op.trace
        calls = trace.calls_of(self.block) if trace is not None else None
        if not calls or op.module_pass > len(calls):
            return False
        call = calls[op.module_pass - 1]
        before = sum(1 for o in trace.ops[call.op_start : op.index] if self._direct(o))
        return before == self.nth - 1

    def match(self, trace: Trace) -> list[Op | ModuleCall]:
        out: list[Op | ModuleCall] = []
        for call in _calls(trace, self.block, self.pass_index, self.name):
            direct = [o for o in trace.ops[call.op_start : call.op_end]
                      if self._direct(o) and o.module_pass == call.pass_index]
            if len(direct) < self.nth:
                raise SiteNotFoundError(
                    f"{self.name}: block {call.key} made {len(direct)} direct call(s) of "
                    f"{sorted(self.funcs)}, expected at least {self.nth}",
                    site=self.name,
                    remedy="The adapter's rule does not fit this model's code; read the op in "
                    "trace.table(tl.in_module(block)) and select it by label.",
                )
            out.append(direct[self.nth - 1])
        return out

    def at_pass(self, pass_index: int) -> BlockOp:
        """The same rule restricted to one pass of the block."""
        return BlockOp(self.block, self.funcs, self.nth, pass_index, self.name)

    def describe(self) -> str:
        return f"block_op({self.block!r}, {sorted(self.funcs)}, nth={self.nth})"

    __repr__ = describe


# -- where a family keeps its parts ------------------------------------------------------


@dataclass(frozen=True)
class ResidualAdd:
    """``resid_mid`` is the ``nth`` ``funcs`` op made directly in the block."""

    nth: int = 1
    funcs: tuple[str, ...] = ("add",)


@dataclass(frozen=True)
class OutputOf:
    """``resid_mid`` is the output of this module, relative to the block."""

    path: str


@dataclass(frozen=True)
class Absent:
    """The family has no such site; ``reason`` says why (shown in the error)."""

    reason: str


def base_prefix(model: nn.Module) -> str:
    """Address of a transformers model's base model inside it (``'transformer.'``), or ''."""
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        return ""
    for name, module in model.named_modules():
        if module is base:
            return f"{name}."
    return ""


def _exists(model: nn.Module, address: str) -> bool:
    try:
        model.get_submodule(address)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class Layout:
    """Where one model family keeps its parts; ``view()`` turns it into an ArchView.

    Paths are relative to the base model (``model.base_model``, found automatically, so the
    bare model and its LM-head wrapper share one layout) except ``unembed``, which is
    relative to the model itself; ``attn``/``mlp`` are relative to a block. A part that is
    absent from a particular model (no LM head on a bare model) becomes an unavailable site
    whose error says so.
    """

    blocks: str
    attn: str | None
    mlp: str | None
    resid_mid: ResidualAdd | OutputOf | Absent
    embed: str | None = None
    embed_out: str | None = None  # the module whose output is block 0's input
    unembed: str | None = None
    pos_embed: str | None = None  # a learned position embedding added to the residual (GPT-2's wpe)

    def _contradictions(self, model: nn.Module, adapter: str, blocks: list[str]) -> None:
        """Refuse a declared attn/mlp that no block has, or that the structure shows in the other role."""
        if not blocks:
            return
        inferred = infer_block(model.get_submodule(blocks[0]), blocks[0])
        seen = {"attn": inferred.path("attn"), "mlp": inferred.path("mlp")}
        for role, declared, other in (("attn", self.attn, "mlp"), ("mlp", self.mlp, "attn")):
            if declared is None:
                continue
            why = None
            if not any(_exists(model, f"{b}.{declared}") for b in blocks):
                why = f"no block has a module {declared!r}"
            elif seen[other] is not None and seen[other] == declared and seen[role] != declared:
                why = f"{declared!r} is the block's {other} by its structure ({role}: {seen[role]!r})"
            if why is not None:
                found = [v for v in (seen["attn"], seen["mlp"]) if v]
                fix = {k: v for k, v in seen.items() if v}
                raise LayoutInferenceError(
                    f"adapter {adapter!r} declares {role}={declared!r} for the blocks of {type(model).__name__}, "
                    f"which contradicts the structure: {why}; the structure shows attn={seen['attn']!r}, "
                    f"mlp={seen['mlp']!r}", site=role, candidates=found,
                    remedy=_declare(adapter, self.blocks, **fix))

    def view(self, model: nn.Module, adapter: str, *, n_heads: int | None = None,
             n_kv_heads: int | None = None, head_dim: int | None = None, d_model: int | None = None,
             root: str | None = None, transformerlens: dict[str, str] | None = None) -> ArchView:
        """Build the view of ``model``; ``transformerlens`` maps the TransformerLens hook names that hold
        the same tensor as a canonical site in this family to its kind (``{"hook_mlp_out": "mlp"}``).

        Raises:
            LayoutInferenceError: the block list, or a declared attn/mlp, is not where the structure shows it
                (the error names what the module tree shows and how to declare it).
        """
        prefix = base_prefix(model) if root is None else root
        container = f"{prefix}{self.blocks}"
        try:
            blocks_module = model.get_submodule(container)
        except AttributeError:
            found = [name for _, name in block_candidates(model)]
            raise LayoutInferenceError(
                f"adapter {adapter!r} declares blocks={self.blocks!r}, but {type(model).__name__} has no module "
                f"{container!r}; the block lists its module tree shows: {found or 'none'}",
                site="blocks", candidates=found,
                remedy=_declare(adapter, found[0].removeprefix(prefix) if found else "...") + " " + ADAPTER_REMEDY,
            ) from None
        blocks = [f"{container}.{name}" for name, _ in blocks_module.named_children()]
        self._contradictions(model, adapter, blocks)
        targets: dict[str, Selector | str] = {}

        def module_or_absent(address: str | None, what: str) -> Selector | str:
            if address is None:
                return f"adapter {adapter!r} does not define {what} for this family"
            if not _exists(model, address):
                return f"{type(model).__name__} has no {what} module ({address!r})"
            return ModuleOutput(address)

        embed_out = f"{prefix}{self.embed_out}" if self.embed_out else None
        for i, block in enumerate(blocks):
            targets[f"blocks.{i}"] = ModuleOutput(block)
            targets[f"blocks.{i}.resid_post"] = ModuleOutput(block)
            targets[f"blocks.{i}.attn"] = module_or_absent(self.attn and f"{block}.{self.attn}", "attention")
            targets[f"blocks.{i}.mlp"] = module_or_absent(self.mlp and f"{block}.{self.mlp}", "MLP")
            if i > 0:
                via: Selector | None = ModuleOutput(blocks[i - 1])
            else:
                via = ModuleOutput(embed_out) if embed_out and _exists(model, embed_out) else None
            targets[f"blocks.{i}.resid_pre"] = InputOf(block, via, name=f"blocks.{i}.resid_pre")
            mid = self.resid_mid
            if isinstance(mid, ResidualAdd):
                targets[f"blocks.{i}.resid_mid"] = BlockOp(block, mid.funcs, mid.nth, name=f"blocks.{i}.resid_mid")
            elif isinstance(mid, OutputOf):
                targets[f"blocks.{i}.resid_mid"] = module_or_absent(f"{block}.{mid.path}", "resid_mid")
            else:
                targets[f"blocks.{i}.resid_mid"] = mid.reason
        targets["embed"] = module_or_absent(self.embed and f"{prefix}{self.embed}", "token embedding")
        targets["unembed"] = module_or_absent(self.unembed, "unembedding (LM head)")
        targets["pos_embed"] = module_or_absent(self.pos_embed and f"{prefix}{self.pos_embed}",
                                                "learned position embedding")
        config = getattr(model, "config", None)
        return ArchView(
            adapter=adapter,
            model_type=getattr(config, "model_type", None),
            n_layers=len(blocks),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            d_model=d_model,
            blocks=blocks,
            targets=targets,
            model_ref=weakref.ref(model),
            transformerlens=dict(transformerlens or {}),
        )


def _declare(adapter: str, blocks: str, **roles: str) -> str:
    """How to declare the layout the structure shows, in the adapter's ``view()``."""
    parts = ", ".join([f"blocks={blocks!r}", *(f"{k}={v!r}" for k, v in roles.items())])
    return f"Fix adapter {adapter!r}: return torchlens.arch.Layout({parts}, ...).view(model, {adapter!r})."


def config_dims(config: Any) -> dict[str, int | None]:
    """``n_heads``, ``n_kv_heads``, ``head_dim``, ``d_model`` read from a transformers-style config.

    A size that differs per layer (a heterogeneous config: reading it raises transformers'
    ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError) has no one value: it is None, and
    ``head_dim`` is then not derived from the others.
    """
    per_layer: list[str] = []

    def first(*names: str) -> Any:
        for n in names:
            try:
                v = getattr(config, n, None)
            except RuntimeError:
                per_layer.append(n)
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    d_model = first("hidden_size", "n_embd", "d_model", "dim")
    n_heads = first("num_attention_heads", "n_head", "num_heads", "n_heads")
    n_kv = first("num_key_value_heads", "n_kv_heads", "num_kv_heads") or n_heads
    head_dim = first("head_dim", "d_head", "attention_head_size")
    if head_dim is None and d_model and n_heads and not per_layer:
        head_dim = d_model // n_heads
    return {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim, "d_model": d_model}


# -- the view ------------------------------------------------------------------------------


@dataclass(eq=False)
class ArchView:
    """What an adapter knows about one model: sizes, block addresses, canonical sites.

    ``targets`` maps each canonical name to a selector, or to a string saying why the site
    does not exist for this model (e.g. GPT-NeoX's parallel residual has no ``resid_mid``), or
    to the typed error a read of it raises (an inferred layout that could not decide).
    ``sources`` says where each part came from (``"declared"`` by a family adapter, or how it
    was inferred); ``tl.arch.describe`` prints it.
    """

    adapter: str
    model_type: str | None
    n_layers: int
    n_heads: int | None
    n_kv_heads: int | None
    head_dim: int | None
    d_model: int | None
    blocks: list[str]
    targets: dict[str, Selector | str] = field(repr=False)
    # weak: views are cached per model (weak keys), and a strong back-reference would pin it
    model_ref: weakref.ref | None = field(default=None, repr=False)
    sources: dict[str, str] = field(default_factory=dict, repr=False)
    # TransformerLens hook names (``hook_resid_pre``) holding the same tensor as a canonical kind in this
    # family, declared by its adapter (``torchlens.arch.tl_names``); every other one is refused, explained.
    transformerlens: dict[str, str] = field(default_factory=dict, repr=False)

    def names(self, kind: str | None = None) -> list[str]:
        """Canonical names this model has; ``kind`` ('mlp', 'resid_post' ...) keeps one per block."""
        if kind is None:
            return [n for n, t in self.targets.items() if not _absent(t)]
        if kind in ("embed", "pos_embed", "unembed"):
            return [kind] if not _absent(self.targets.get(kind)) else []
        if kind not in KINDS and kind != "block":
            raise SiteNotFoundError(f"no canonical site kind {kind!r}; kinds: {[*KINDS, 'block', 'embed']}",
                                    site=kind)
        suffix = "" if kind == "block" else f".{kind}"
        return [f"blocks.{i}{suffix}" for i in range(self.n_layers)
                if f"blocks.{i}{suffix}" in self.targets and not _absent(self.targets[f"blocks.{i}{suffix}"])]

    def layer_indices(self, layers: Iterable[int] | int | None = None, kind: str | None = None, *,
                      boundaries: bool = False) -> list[int]:
        """Block indices as every workflow reads them: Python's meaning (``-1`` is the last block).

        The one owner of what a ``layers=`` argument means (patching grids, causal tracing,
        attribution, logit lens, head patching by index).

        Args:
            layers: block indices, negative ones counting from the end; None: every block
                (that has ``kind``).
            kind: a canonical site kind (``"mlp"``, ``"attn"`` ...) the blocks must have.
            boundaries: index the ``n_layers + 1`` layer boundaries of the residual stream
                instead of the blocks (0: the embeddings' output, ``n_layers``: the last
                block's output; ``-1`` is that last one), as ``tl.accumulated_resid`` and
                ``tl.logit_lens`` rows do.

        Returns:
            non-negative block indices, in the order given.

        Raises:
            SiteNotFoundError: an index outside ``-n_layers .. n_layers-1``, or a block without ``kind``.
            InvalidArgumentError: an index that is not an int.
        """
        if boundaries:
            if layers is None:
                return list(range(self.n_layers + 1))
            return python_indices(layers, self.n_layers + 1, what="layer", error=SiteNotFoundError,
                                  site="layers", axis=f"this {self.adapter} model has {self.n_layers + 1} layer "
                                  f"boundaries ({self.n_layers} blocks and the embeddings)")
        have = [int(n.split(".")[1]) for n in self.names(kind or "block")]
        rows = have if layers is None else python_indices(
            layers, self.n_layers, what="layer", error=SiteNotFoundError, site="layers",
            axis=f"this {self.adapter} model has {self.n_layers} blocks")
        missing = [i for i in range(self.n_layers) if i not in have] if layers is None and kind else \
            [i for i in rows if i not in have]
        if missing:
            raise self._lacks(kind, missing, have)
        return rows

    def _lacks(self, kind: str | None, missing: list[int], have: list[int]) -> SiteNotFoundError:
        """The error for blocks without ``kind``: which adapter, why (its reason), what its blocks have."""
        target = self.targets.get(f"blocks.{missing[0]}.{kind}")
        why = target.message if isinstance(target, TorchLensError) else target if isinstance(target, str) else ""
        kinds = [k for k in KINDS if self.names(k)]
        where = f"blocks {missing}" if have else f"the blocks of this {self.adapter} model"
        return SiteNotFoundError(
            f"{where} have no {kind} site{f' ({why})' if why else ''}; the {self.adapter} adapter gives "
            f"{'blocks ' + str(have) + ' a ' + str(kind) + ' site, and ' if have else ''}its blocks {kinds}",
            site=kind, remedy=f"Pick layers among {have}." if have else f"Use one of {kinds}.")

    def selector(self, name: str) -> Selector:
        """The selector a canonical name (optionally ``name:pass``) stands for in this model.

        Raises:
            SiteNotFoundError: the name is not canonical, or this model has no such site.
        """
        base, pass_index = split_pass(name)
        target = self.targets.get(base)
        if target is None and TL_HOOK.match(base):
            return self.selector(self._from_transformerlens(base) + (f":{pass_index}" if pass_index else ""))
        if target is None:
            raise SiteNotFoundError(
                f"{base!r} is not a canonical site of this {self.adapter} model ({self.n_layers} blocks); "
                f"nearest: {nearest(base, self.targets)}",
                site=name,
                candidates=nearest(base, self.targets),
            )
        if isinstance(target, TorchLensError):
            raise type(target)(target.message, remedy=target.remedy, **target.fields)
        if isinstance(target, str):
            raise SiteNotFoundError(f"{base!r} does not exist for this model: {target}", site=name,
                                    remedy="Pick another canonical site (tl.arch(model).names()) or a real "
                                    "module path.")
        return _with_pass(target, pass_index) if pass_index is not None else target

    def _from_transformerlens(self, name: str) -> str:
        """The canonical name holding what TransformerLens's ``name`` holds in this family.

        Raises:
            SiteNotFoundError: no canonical site holds that tensor here; the message says how to read it.
        """
        found = TL_HOOK.match(name)
        kind = self.transformerlens.get(found["hook"]) if found["part"] is None and found["sae"] is None else None
        top = kind in ("embed", "pos_embed", "unembed")
        if kind is not None and (found["block"] is None) == top:
            return kind if top else f"blocks.{found['block']}.{kind}"
        hint = transformerlens_hint(name)
        kinds = [k for k in KINDS if self.names(k)] + [k for k in ("embed", "pos_embed", "unembed") if self.names(k)]
        raise SiteNotFoundError(
            f"{name!r} is a TransformerLens hook name; TorchLens names sites by canonical names (blocks.L.<kind>, "
            f"kinds here: {kinds}) or the model's real module paths"
            + (f"; the {self.adapter} adapter declares {sorted(self.transformerlens)} equal to TransformerLens's"
               if self.transformerlens else f"; the {self.adapter} adapter maps no TransformerLens names"),
            site=name,
            remedy=(f"For {name!r}: {hint}." if hint else
                    "Pick a canonical site (tl.arch(model).names()) or a real module path (trace.modules)."),
        )

    def resolve(self, name: str) -> str:
        """The module address whose output is this canonical site (``'transformer.h.3.mlp'``).

        Raises:
            SiteNotFoundError: no module output holds it (``resid_mid`` is an op inside a block).
        """
        sel = self.selector(name)
        paths = sel.module_paths()
        if not paths or len(paths) != 1:
            raise SiteNotFoundError(
                f"{name!r} is an op inside a block, not a module's output ({sel.describe()})",
                site=name,
                remedy=f"Select it with tl.module({name!r}) on a tl.trace capture (every op is recorded there).",
            )
        return paths[0]

    def module(self, name: str) -> nn.Module:
        """The ``nn.Module`` whose output is a canonical site (``view.module("blocks.0.attn")``).

        Raises:
            SiteNotFoundError: as ``resolve``.
        """
        model = self.model_ref() if self.model_ref is not None else None
        if model is None:
            raise SiteNotFoundError(f"this view of {self.adapter!r} holds no model to look {name!r} up in",
                                    site=name, remedy="Call tl.arch(model) again on a live model.")
        return model.get_submodule(split_pass(self.resolve(name))[0])

    def describe(self) -> str:
        """A table of the parts this view found: where each is (block 0) and whether the adapter declared
        it or the generic adapter inferred it (and how), or why it is refused."""
        rows = [("blocks", f"{self.blocks[0].rpartition('.')[0]} ({self.n_layers})" if self.blocks else "-")]
        for kind in KINDS:
            if kind in KINDS[:5] or any(not _absent(self.targets.get(f"blocks.{i}.{kind}", ""))
                                        for i in range(self.n_layers)):
                rows.append((kind, _where(self._first_with(kind))))
        rows += [("embed", _where(self.targets.get("embed"))), ("unembed", _where(self.targets.get("unembed")))]
        if "norms" in self.sources:
            rows.insert(3, ("norms", "(in each block)"))
        heads = f"{self.n_heads} heads ({self.n_kv_heads} kv) x {self.head_dim}, d_model {self.d_model}"
        width = max(46, *(len(where) + 2 for _, where in rows))
        lines = [f"{self.adapter} adapter, model_type {self.model_type!r}: {heads}",
                 f"{'part':<11}{'block 0':<{width}}source"]
        for part, where in rows:
            source = self.sources.get(part) or f"declared by adapter {self.adapter!r}"
            if where.startswith("refused: ") and source.startswith(("absent: ", "refused")):
                source = "-"  # the cell already says why
            lines.append(f"{part:<11}{where:<{width}}{source}")
        return "\n".join(lines)

    def _first_with(self, kind: str) -> Any:
        """Block 0's target of ``kind``, or the first block that has it (a hybrid's attention layer)."""
        first = self.targets.get(f"blocks.0.{kind}")
        if not _absent(first):
            return first
        return next((t for i in range(self.n_layers) if not _absent(t := self.targets.get(f"blocks.{i}.{kind}"))),
                    first)

    def __repr__(self) -> str:
        return (f"ArchView(adapter={self.adapter!r}, model_type={self.model_type!r}, n_layers={self.n_layers}, "
                f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"d_model={self.d_model}, blocks=[{self.blocks[0] if self.blocks else ''} ...])")


def _where(target: Any) -> str:
    """One cell of ``describe``: the site a target names, or that it is refused."""
    if target is None:
        return "-"
    if _absent(target):
        return "refused: " + (target if isinstance(target, str) else type(target).__name__)
    paths = target.module_paths()
    return paths[0] if paths and len(paths) == 1 and isinstance(target, ModuleOutput) else target.describe()


def _absent(target: Any) -> bool:
    """Whether a ``targets`` entry says the site does not exist (a reason, or the error to raise)."""
    return isinstance(target, (str, TorchLensError))


def _with_pass(sel: Selector, pass_index: int) -> Selector:
    if isinstance(sel, ModuleOutput):
        return ModuleOutput(f"{sel.path}:{pass_index}")
    if isinstance(sel, InputOf):
        return InputOf(sel.address, sel.via and _with_pass(sel.via, pass_index), pass_index, sel.name)
    if isinstance(sel, BlockOp):
        return sel.at_pass(pass_index)
    return sel
