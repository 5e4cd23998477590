"""The fallback adapter: infers the layout of a model no family adapter knows.

The block list and each block's sublayers come from ``torchlens.arch.infer`` (the rules, ranked,
never guessed): ``attn``, ``mlp``, and where a block has them ``mixer`` (state-space / linear
attention), ``cross_attn``, and an MoE MLP's ``router`` and ``experts``. Roles are inferred per
block, so alternating layer classes (Jamba's Mamba and attention layers, a dense layer before MoE
ones) each get their own; one shared block called N times (ALBERT) gives N blocks, its passes.

* ``resid_mid``: the block's first own add, offered only where it checks out on the recorded forward
  as ``resid_pre + attn_out`` (or ``+ mixer_out``; ``torchlens.arch.checks``); refused on post-norm
  BERT-style blocks, on blocks with one sublayer, and on T5-style blocks (the add is inside the
  sublayer wrapper).

Where candidates still tie, or none is found, the site holds a ``LayoutInferenceError`` naming
them and how to declare the layout. Head counts come from the config when there is one, else
from the attention module's attributes. ``resid_pre`` read after capture is exact (the op
feeding the block); edited during capture it assumes the blocks are chained (block i's input
is block i-1's output), and for block 0 it needs a ``tl.trace`` capture and an after-the-fact
edit (``fork.do``), since no module is known to produce it. ``ArchView.adapter`` is
``"generic"`` and ``ArchView.sources`` says how each part was found (``tl.arch.describe``).
"""

from __future__ import annotations

import weakref

from torch import nn

from torchlens.arch import ADAPTER_REMEDY, ArchView, InputOf, config_dims
from torchlens.arch.checks import CheckedOutput, CheckedResidualAdd
from torchlens.arch.infer import ROLES, TOWER, BlockRoles, find_blocks, infer_block, is_norm, shared_block
from torchlens.core.selectors import ModuleOutput, Selector
from torchlens.errors import LayoutInferenceError, UnsupportedModelError

UNEMBED = ("lm_head", "unembed", "embed_out", "output", "head", "proj_out")


def _embed_unembed(model: nn.Module, container: str) -> tuple[str | None, str | None]:
    def shared(name: str) -> int:  # how deep the embedding sits beside the blocks (the text model's own)
        return sum(1 for a, b in zip(name.split("."), container.split("."), strict=False) if a == b)

    found = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and container
             and not n.startswith(container + ".") and not TOWER.search(n)]
    embed = max(found, key=shared) if found else None  # max keeps the first of equals (module order)
    vocab = model.get_submodule(embed).num_embeddings if embed else None
    unembed = None
    for name in UNEMBED:
        m = getattr(model, name, None)
        if isinstance(m, nn.Linear) and (vocab is None or m.out_features == vocab):
            unembed = name
            break
    return embed, unembed


def _attn_dims(attn: nn.Module | None) -> dict[str, int | None]:
    def first(*names: str) -> int | None:
        for n in names:
            v = getattr(attn, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    n_heads = first("num_heads", "n_heads", "n_head", "num_attention_heads")
    d_model = first("embed_dim", "hidden_size", "d_model", "n_embd")
    head_dim = first("head_dim", "d_head") or (d_model // n_heads if d_model and n_heads else None)
    n_kv = first("num_key_value_heads", "n_kv_heads", "num_kv_heads") or n_heads
    return {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim, "d_model": d_model}


def _mid(i: int, block: str, roles: BlockRoles, at) -> Selector | str | LayoutInferenceError:
    """``resid_mid`` of one block: the checked first add, or why there is none."""
    first = roles.path("attn") or roles.path("mixer")
    if roles.mid is not None:
        return (f"{block}'s residual adds are inside its sublayer wrappers ({roles.mid} adds the attention's "
                f"output): read {roles.mid}'s output by its real path")
    if first is None:
        return "no attention or mixer was inferred, so there is no residual add to check for resid_mid"
    if roles.post_norm:
        return LayoutInferenceError(
            f"blocks.{i}.resid_mid: {block} is a post-norm BERT-style block; its attention residual add is "
            f"inside {roles.post_norm} (LayerNorm of the sum), not an add of resid_pre and attn",
            site=f"blocks.{i}.resid_mid")
    if roles.path("mlp") is None and "mlp" in roles.absent:
        return f"{block} has one sublayer ({first}): its only residual add is resid_post"
    mlp = roles.path("mlp")
    address, pass_index = at(block)
    return CheckedResidualAdd(address, at(block, first)[0], at(block, mlp)[0] if mlp else None, pass_index,
                              name=f"blocks.{i}.resid_mid")


def _sources(container: str, all_roles: list[BlockRoles], block0: nn.Module, embed: str | None,
             unembed: str | None, shared: bool) -> dict[str, str]:
    roles = all_roles[0]
    first = roles.path("attn") or roles.path("mixer")
    mid = ("refused: no attention or mixer" if first is None else
           "absent: the block has one sublayer" if "mlp" in roles.absent else
           "refused: the add is inside the sublayer wrapper" if roles.mid else
           f"refused: post-norm BERT-style block (the add is inside {roles.post_norm})" if roles.post_norm else
           "inferred: first add in the block, checked on read (= resid_pre + attn/mixer or its post-norm, MLP after "
           "it, resid_post = it + mlp)")
    blocks = (f"inferred: {container}, one shared block called num_hidden_layers times (block L is its pass L+1)"
              if shared else f"inferred: {container} (ranked first of the candidate block lists)")
    out = {"blocks": blocks, "resid_mid": mid,
           "resid_pre": "inferred: the op feeding the block (exact after capture)",
           "resid_post": "inferred: the block's output (check_layout: equals the next resid_pre)",
           "norms": "inferred: " + (", ".join(n for n, m in block0.named_children() if is_norm(m))
                                    or "none among the block's children"),
           "embed": ("inferred: the nn.Embedding beside the blocks (outside them, not in a vision/audio tower)"
                     if embed else "none found"),
           "unembed": f"inferred: {unembed}, a Linear to the vocabulary" if unembed else "none found"}
    for role in ROLES:  # from the first block that has the role (a hybrid's first attention layer)
        how = next((r.how[role] for r in all_roles if role in r.how), None)
        out[role] = how or ("absent: " + roles.absent[role] if role in roles.absent else "refused")
    return out


class GenericAdapter:
    """Serves any model with a repeated block list; tried after every family adapter."""

    name = "generic"
    model_types = ()
    fallback = True

    def view(self, model: nn.Module) -> ArchView:
        container = find_blocks(model)
        shared = shared_block(model) if container is None else None
        if container is None and shared is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no adapter and no repeated block list "
                "(an nn.ModuleList of two or more modules of one class, or of blocks of alternating classes)",
                remedy=ADAPTER_REMEDY,
            )
        if shared is not None:
            container, n = shared
            blocks = [f"{container}:{p}" for p in range(1, n + 1)]
        else:
            blocks = [f"{container}.{name}" if container else name
                      for name, _ in model.get_submodule(container).named_children()]

        def at(block: str, rel: str | None = None) -> tuple[str, int | None]:
            """A block's part as (address, pass): a shared block's pass moves to the end of the address."""
            address, _, pass_index = block.partition(":")
            return (f"{address}.{rel}" if rel else address), (int(pass_index) if pass_index else None)

        def output(block: str, rel: str) -> ModuleOutput:
            address, pass_index = at(block, rel)
            return ModuleOutput(f"{address}:{pass_index}" if pass_index else address)

        embed, unembed = _embed_unembed(model, container)
        targets: dict[str, Selector | str | LayoutInferenceError] = {}
        all_roles = []
        for i, block in enumerate(blocks):
            address, pass_index = at(block)
            roles = infer_block(model.get_submodule(address), address)
            all_roles.append(roles)
            targets[f"blocks.{i}"] = targets[f"blocks.{i}.resid_post"] = output(block, "")
            via = output(blocks[i - 1], "") if i > 0 else None
            targets[f"blocks.{i}.resid_pre"] = InputOf(address, via, pass_index, name=f"blocks.{i}.resid_pre")
            for role in ROLES:
                found = roles.roles.get(role)
                if isinstance(found, str) and role != "router":
                    path = output(block, found).path
                    targets[f"blocks.{i}.{role}"] = CheckedOutput(path, address, f"blocks.{i}.{role}")
                elif isinstance(found, str):  # router logits: one per expert, checked by check_layout
                    targets[f"blocks.{i}.{role}"] = output(block, found)
                elif found is not None:
                    fields = found.fields
                    targets[f"blocks.{i}.{role}"] = LayoutInferenceError(found.message, site=f"blocks.{i}.{role}",
                                                                         candidates=fields["candidates"],
                                                                         rule=fields["rule"])
                else:
                    targets[f"blocks.{i}.{role}"] = roles.absent.get(role, f"{address} has no {role}")
            targets[f"blocks.{i}.resid_mid"] = _mid(i, block, roles, at)
        targets["embed"] = ModuleOutput(embed) if embed else "no nn.Embedding outside the blocks"
        targets["unembed"] = ModuleOutput(unembed) if unembed else "no Linear to the vocabulary (an LM head) found"
        targets["pos_embed"] = "the generic adapter does not infer a learned position embedding"
        config = getattr(model, "config", None)
        dims = config_dims(config) if config is not None else {}
        attn0 = next((r.path("attn") for r in all_roles if r.path("attn")), None)
        if not dims.get("n_heads"):
            first = at(blocks[0])[0]
            dims = _attn_dims(model.get_submodule(f"{first}.{attn0}") if attn0 else None)
        view = ArchView(adapter=self.name, model_type=getattr(config, "model_type", None), n_layers=len(blocks),
                        blocks=blocks, targets=targets, model_ref=weakref.ref(model), **dims)
        view.sources.update(_sources(container, all_roles, model.get_submodule(at(blocks[0])[0]), embed, unembed,
                                     shared is not None))
        return view
