"""Layout inference from the module tree: the block list, and each block's sublayers by role.

The rules, in the order they decide (every one is a ranking, never a guess: where candidates still
tie, the answer is a ``LayoutInferenceError`` naming them and how to declare the layout):

* blocks: ``nn.ModuleList`` / ``nn.Sequential`` of two or more modules, one class each, or
  composite modules of alternating classes each holding a sublayer (Jamba's attention and Mamba
  layers). A list nested inside another candidate's blocks is a block's part (T5's ``layer``,
  an MoE's expert list), not the stack. Ranked: not under a vision/audio tower (a multimodal model's
  text blocks are what ran on tokens), the decoder over the encoder of an encoder-decoder (the
  stack the unembedding reads), composite over single layers, longer, shallower. Two candidates
  that still tie are refused. One shared block called N times (ALBERT) is found from the config's
  ``num_hidden_layers``: block ``i`` is the module's pass ``i + 1``.
* roles, among a block's children (norms, dropouts and activations set aside):
  ``attn`` named attn/attention (not cross-attention, not a linear-attention mixer);
  ``cross_attn`` named encoder_attn/crossattention/EncDecAttention; ``mixer`` a state-space or
  linear-attention sequence mixer (named mixer/mamba/ssm/linear_attn, or its class says Mamba/SSM);
  ``mlp`` named mlp/ffn/feed_forward/moe (else ``fc1``/``fc2`` in the block: ``fc2``; else
  BERT's ``intermediate``/``output``: ``output.dense``). A block whose sublayers sit in a list of
  wrappers (T5's ``layer.0`` self-attention, ``layer.1`` cross-attention, ``layer.-1`` FF) is read
  through the wrappers, by class name. Inside the MLP, an MoE shows ``router`` (the child named
  gate/router: its output is the router logits) and ``experts`` (the routed experts' combined output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import LayoutInferenceError

__all__ = ["ROLES", "TOWER", "BlockRoles", "block_candidates", "find_blocks", "infer_block", "is_norm", "refusal",
           "shared_block"]

ROLES = ("attn", "cross_attn", "mixer", "mlp", "router", "experts")
ATTN = re.compile(r"attn|attention", re.I)
CROSS = re.compile(r"encoder_?attn|cross_?attn|cross_?attention|enc_?dec_?attention", re.I)
MIXER = re.compile(r"mixer|mamba|ssm|linear_?attn|linear_?attention|conv_?mixer|short_?conv|fourier", re.I)
# class names, case-sensitive CamelCase words ("GptOssMLP" holds no SSM)
MIXER_CLASS = re.compile(r"Mamba|SSM|Ssm(?![a-z])|Rwkv\w*Attention|GatedDelta|LinearAttention|LinearAttn")
ATTN_CLASS = re.compile(r"attention|attn", re.I)
MLP = re.compile(r"mlp|ffn|feed_?forward|moe|dense_?relu_?dense|^ff$", re.I)
MLP_CLASS = re.compile(r"mlp|ffn|feed_?forward|moe|layerff$|ff$", re.I)
FOLD_NORM = re.compile(r"^(layer_?norm|ln|norm)$", re.I)  # an output norm, not q_norm / kv_a_layernorm
FOLD_PROJ = re.compile(r"^(dense|o_proj|out_proj|output)$")
NORM_CLASS = re.compile(r"norm(\d*d)?(gated)?$", re.I)
# modules on the residual path around sublayers (hyper-connections, Inkling 2's BlockAttentionResidual)
HYPER = re.compile(r"_hc$|hyper_?connection|residual", re.I)
DECODER = re.compile(r"(^|[._])decoder(\.|$)")  # model.decoder.layers, text_decoder.layers
OUT_LINEAR = re.compile(r"out|down|fc2|wo$", re.I)
ROUTER = re.compile(r"^(gate|router|switch)$", re.I)
EXPERTS = re.compile(r"^experts$", re.I)
# path components of a multimodal model's non-text towers: their blocks do not run on token ids
TOWER = re.compile(r"(^|\.)[a-z_]*(vision|visual|image|img|vit|audio|speech|video|vq|pixel|patch)[a-z_0-9]*(\.|$)",
                   re.I)


def is_norm(module: nn.Module) -> bool:
    """LayerNorm/RMSNorm-like: a class name ending in ``Norm`` (not RobertaPreLayerNormAttention), or a leaf whose
    parameters are all 1-D."""
    if NORM_CLASS.search(type(module).__name__):
        return True
    params = [p for _, p in module.named_parameters(recurse=False)]
    return bool(params) and not any(True for _ in module.children()) and all(p.dim() == 1 for p in params)


def _sublayer(module: nn.Module) -> bool:
    """A module that can be a sublayer: it has parameters (not a dropout or activation) and is not a norm."""
    return any(True for _ in module.parameters()) and not is_norm(module)


def refusal(block: str, role: str, found: list[str], rule: str) -> LayoutInferenceError:
    """The error a read of an undecided role raises: the candidates (or none) and the rule that weighed them."""
    what = f"candidates {found} tie" if found else "no candidate was found"
    return LayoutInferenceError(f"{role} of {block!r} was not inferred: {what} ({rule})", site=role,
                                candidates=found, rule=rule)


@dataclass
class BlockRoles:
    """One block's sublayers by role: a path relative to the block, a refusal, or a reason it has none."""

    roles: dict[str, str | LayoutInferenceError] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    mid: str | None = None  # the wrapper whose output is resid_mid (T5), or None: the block's own add
    post_norm: str | None = None  # the attention's part that adds the residual and normalises (BERT, ALBERT)

    def path(self, role: str) -> str | None:
        found = self.roles.get(role)
        return found if isinstance(found, str) else None


def _wrappers(block: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """A block whose only sublayer child is a list of wrappers of distinct classes (T5's ``layer``)."""
    kids = [(n, m) for n, m in block.named_children() if _sublayer(m)]
    if len(kids) != 1 or not isinstance(kids[0][1], (nn.ModuleList, nn.Sequential)):
        return None
    items = list(kids[0][1].named_children())
    if len(items) < 2 or len({type(m) for _, m in items}) != len(items):
        return None
    return kids[0][0], items


def _inner(wrapper: nn.Module, pattern: re.Pattern) -> str | None:
    """The one child of a wrapper named for its role (T5LayerSelfAttention.SelfAttention), else None."""
    named = [n for n, m in wrapper.named_children() if pattern.search(n) and _sublayer(m)]
    return named[0] if len(named) == 1 else None


def _by_class(block: nn.Module, out: BlockRoles) -> bool:
    """Roles of a block read through its list of sublayer wrappers (T5), by the wrappers' class names."""
    found = _wrappers(block)
    if found is None:
        return False
    name, items = found
    for role, pattern, inner in (("cross_attn", CROSS, ATTN), ("attn", ATTN, ATTN), ("mlp", MLP_CLASS, MLP)):
        hits = [(i, m) for i, m in items if pattern.search(type(m).__name__)
                and not (role == "attn" and CROSS.search(type(m).__name__))
                and not any(out.path(r) == f"{name}.{i}" or (out.path(r) or "").startswith(f"{name}.{i}.")
                            for r in out.roles)]
        if len(hits) != 1:
            continue
        i, wrapper = hits[0]
        child = _inner(wrapper, inner)
        out.roles[role] = f"{name}.{i}.{child}" if child else f"{name}.{i}"
        out.how[role] = f"inferred: {type(wrapper).__name__} in {name} (a sublayer wrapper adding its own residual)"
        if role == "attn":
            out.mid = f"{name}.{i}"
    return "attn" in out.roles or "mlp" in out.roles


def infer_block(block: nn.Module, address: str) -> BlockRoles:
    """Each role of ``block`` (a path relative to it), a refusal naming tied candidates, or why it is absent."""
    out = BlockRoles()
    if _by_class(block, out):
        _moe(block, out)
        return out
    kids = [(n, m) for n, m in block.named_children() if _sublayer(m)]
    kinds = {n: _kind(n, m) for n, m in kids}
    mixers = [n for n, k in kinds.items() if k == "mixer"]
    cross = [n for n, k in kinds.items() if k == "cross_attn"]
    attn = [n for n, k in kinds.items() if k == "attn"]
    attn = _by_class_name(block, attn, ATTN_CLASS)
    rule = "children named attn/attention; norms, dropouts, cross-attention and state-space mixers set aside"
    if len(attn) == 1:
        out.roles["attn"] = attn[0]
        kid = block.get_submodule(attn[0])
        grand = dict(kid.named_children())
        folded = [n for n, m in grand.items() if isinstance(m, nn.Linear) and FOLD_PROJ.search(n)]
        if "self" in grand and "output" in grand:  # BERT style: attention.output folds in the residual
            out.roles["attn"] = f"{attn[0]}.self"
            out.how["attn"] = "inferred: BERT-style attention, its 'self' part (output adds the residual)"
            out.post_norm = f"{attn[0]}.output"
        elif any(is_norm(m) and FOLD_NORM.search(n) for n, m in grand.items()) and len(folded) == 1:
            # ALBERT style: the attention module ends in LayerNorm(x + dense(ctx)); its output is the stream
            out.roles["attn"] = f"{attn[0]}.{folded[0]}"
            out.how["attn"] = (f"inferred: attention that folds in the residual and a norm, its output projection "
                               f"{folded[0]} (before the add)")
            out.post_norm = attn[0]
        else:
            out.how["attn"] = "inferred: the child named like attention"
    elif attn:
        out.roles["attn"] = refusal(address, "attention", attn, rule)
    if len(cross) == 1:
        out.roles["cross_attn"], out.how["cross_attn"] = cross[0], "inferred: the child named like cross-attention"
    elif cross:
        out.roles["cross_attn"] = refusal(address, "cross-attention", cross,
                                          "children named encoder_attn/crossattention")
    if len(mixers) == 1:
        out.roles["mixer"] = mixers[0]
        out.how["mixer"] = "inferred: the state-space / linear-attention mixer (named or classed so)"
        grand = dict(block.get_submodule(mixers[0]).named_children())
        if "self" in grand and "output" in grand:  # BERT style (FNet's fourier): output folds in the residual
            out.roles["mixer"], out.post_norm = f"{mixers[0]}.self", f"{mixers[0]}.output"
            out.how["mixer"] = "inferred: a BERT-style mixer (FNet's Fourier transform), its 'self' part"
    elif mixers:
        out.roles["mixer"] = refusal(address, "mixer", mixers, "children named mixer/mamba/ssm/linear_attn")
    if "attn" not in out.roles:
        out.absent["attn"] = (f"{address} mixes tokens with a non-attention mixer (state-space, linear attention, "
                              "Fourier): read blocks.L.mixer" if "mixer" in out.roles else
                              refusal(address, "attention", [], rule).message)
    _mlp(block, address, kids, [n for n, k in kinds.items() if k == "mlp"], out)
    _moe(block, out)
    return out


def _by_class_name(block: nn.Module, names: list[str], pattern: re.Pattern) -> list[str]:
    """Tied candidates narrowed to the one whose class also names the role (Inkling's ``attn_sconv`` is a
    ShortConvolution beside ``self_attn``), else left tied."""
    if len(names) < 2:
        return names
    classed = [n for n in names if pattern.search(type(block.get_submodule(n)).__name__)]
    return classed if len(classed) == 1 else names


def _kind(name: str, module: nn.Module) -> str | None:
    """The role a block's child is named (or, in a slot named ``mixer``, classed) for, or None."""
    cls = type(module).__name__
    if HYPER.search(name) or HYPER.search(cls):
        return None  # mixes residual streams around a sublayer (hyper-connections), is not one
    if CROSS.search(name):
        return "cross_attn"
    if MIXER_CLASS.search(cls):
        return "mixer"
    if MIXER.search(name):  # a slot named mixer holding attention or an MLP (Nemotron-H): its class says
        return "attn" if ATTN_CLASS.search(cls) else "mlp" if MLP_CLASS.search(cls) else "mixer"
    if ATTN.search(name):
        return "attn"
    return "mlp" if MLP.search(name) else None


def _mlp(block: nn.Module, address: str, kids: list[tuple[str, nn.Module]], named: list[str],
         out: BlockRoles) -> None:
    named = _by_class_name(block, named, MLP_CLASS)
    by_name = dict(block.named_children())
    outputs = [n for n in named if isinstance(by_name[n], nn.Linear) and OUT_LINEAR.search(n)]
    if len(named) > 1 and all(isinstance(by_name[n], nn.Linear) for n in named) and len(outputs) == 1:
        named = outputs  # the MLP's linears directly in the block (ALBERT's ffn, ffn_output): its output one
    if len(named) == 1:
        out.roles["mlp"], out.how["mlp"] = named[0], "inferred: the child named like an MLP"
    elif named:
        out.roles["mlp"] = refusal(address, "MLP", named, "named mlp/ffn/feed_forward/moe, norms and dropouts excluded")
    elif isinstance(by_name.get("fc1"), nn.Linear) and isinstance(by_name.get("fc2"), nn.Linear):
        out.roles["mlp"], out.how["mlp"] = "fc2", "inferred: fc1/fc2 linears in the block, the MLP's output is fc2's"
    elif "intermediate" in by_name and _sublayer(getattr(by_name.get("output"), "dense", None) or nn.Identity()):
        out.roles["mlp"] = "output.dense"
        out.how["mlp"] = "inferred: intermediate/output (BERT style), the down-projection output.dense"
    elif len(kids) == 1 and (out.path("mixer") or out.path("attn")):
        out.absent["mlp"] = f"{address} has one sublayer, {kids[0][0]} (a state-space block has no MLP)"
    else:
        out.roles["mlp"] = refusal(address, "MLP", [], "no mlp/ffn-named child, no fc1/fc2 pair, "
                                   "no intermediate/output pair")


def _moe(block: nn.Module, out: BlockRoles) -> None:
    """An MoE MLP's router (gate logits) and experts, where the MLP module holds them as children."""
    mlp = out.path("mlp")
    module = block.get_submodule(mlp) if mlp else None
    kids = dict(module.named_children()) if module is not None else {}
    routers = [n for n, m in kids.items() if ROUTER.search(n) and _sublayer(m)]
    experts = [n for n, m in kids.items() if EXPERTS.search(n) and _sublayer(m)]
    if len(routers) == 1 and len(experts) == 1:
        out.roles["router"] = f"{mlp}.{routers[0]}"
        out.roles["experts"] = f"{mlp}.{experts[0]}"
        out.how["router"] = "inferred: the MoE MLP's child named gate/router (its first output: router logits)"
        out.how["experts"] = "inferred: the MoE MLP's experts (the routed experts' combined output)"
        return
    reason = "not an MoE block (its MLP has no gate/router child beside an experts child)"
    out.absent.setdefault("router", reason)
    out.absent.setdefault("experts", reason)


def _roles_of(module: nn.Module) -> bool:
    """Whether a list item looks like a block: some child named or classed as a sublayer."""
    if _wrappers(module) is not None:
        return True
    return any(_sublayer(m) and (ATTN.search(n) or MIXER.search(n) or MLP.search(n)
                                 or MIXER_CLASS.search(type(m).__name__))
               for n, m in module.named_children())


def block_candidates(model: nn.Module) -> list[tuple[tuple, str]]:
    """Every candidate block list with its rank key, best first (see the module docstring)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        composite = all(any(True for _ in c.children()) for c in children)
        one_class = len({type(c) for c in children}) == 1
        if not one_class and not (composite and all(_roles_of(c) for c in children)):
            continue
        found.append((name, composite))
    names = [n for n, _ in found]
    outer = [(n, c) for n, c in found if not any(n.startswith(f"{o}.") for o in names if o != n)]
    decoder = any(DECODER.search(n) for n, _ in outer)
    ranked = []
    for name, composite in outer:
        side = 1 if DECODER.search(name) else (0 if decoder else 1)
        key = (not TOWER.search(name), side, composite, len(model.get_submodule(name)._modules), -name.count("."))
        ranked.append((key, name))
    ranked.sort(key=lambda kn: kn[0], reverse=True)
    return ranked


def find_blocks(model: nn.Module) -> str | None:
    """Address of the repeated block list, or None.

    Raises:
        LayoutInferenceError: two candidate lists rank the same (naming both, and how to declare one).
    """
    ranked = block_candidates(model)
    if not ranked:
        return None
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        tied = [n for k, n in ranked if k == ranked[0][0]]
        raise LayoutInferenceError(
            f"{type(model).__name__}: the block list was not inferred: candidates {tied} tie (same class of "
            "blocks, same length and depth, neither under a vision/audio tower nor an encoder beside a decoder)",
            site="blocks", candidates=tied,
            remedy=f"Declare the layout: an adapter whose view() returns torchlens.arch.Layout(blocks={tied[0]!r}, "
                   "attn=..., mlp=..., resid_mid=...).view(model, name), registered with torchlens.plugins.register "
                   "(docs/plugins.md); or name real module paths.")
    return ranked[0][1]


def shared_block(model: nn.Module) -> tuple[str, int] | None:
    """One block module called ``num_hidden_layers`` times (ALBERT's shared layer): (address, passes), or None."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 2:
        return None
    blocks = [name for name, m in model.named_modules()
              if name and not isinstance(m, (nn.ModuleList, nn.Sequential)) and _roles_of(m)
              and not any(True for _, c in m.named_children() if _roles_of(c))]
    outer = [b for b in blocks if not any(b.startswith(f"{o}.") for o in blocks if o != b)]
    return (outer[0], n) if len(outer) == 1 else None
