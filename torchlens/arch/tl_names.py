"""TransformerLens hook names (``blocks.3.hook_resid_pre``) met where a canonical name is expected.

A user coming from TransformerLens types its names. Each family adapter declares which of them hold
the same tensor as one of its canonical sites (``ArchView.transformerlens``: GPT-2's
``blocks.{i}.hook_mlp_out`` is ``blocks.{i}.mlp``; BERT's ``hook_resid_post`` is the sum *before* the
block's LayerNorm, which no canonical site holds, so BERT does not declare it); those resolve to that
site. Every other TransformerLens name raises ``SiteNotFoundError`` saying how TorchLens reads that
value (and how its shape or meaning differs), never another tensor in its place.
"""

from __future__ import annotations

import re

__all__ = ["TL_HOOK", "TL_PRE_NORM", "is_transformerlens", "transformerlens_hint"]

# ``blocks.3.hook_resid_pre``, ``blocks.3.attn.hook_z``, ``blocks.3.ln1.hook_scale``, ``hook_embed``,
# ``ln_final.hook_normalized``, and SAELens's sub-hooks ``blocks.3.hook_resid_post.hook_sae_acts_post``.
TL_HOOK = re.compile(
    r"^(?:blocks\.(?P<block>\d+)\.)?(?:(?P<part>(?!hook_)[a-z_0-9]+)\.)?(?P<hook>hook_[a-z_0-9]+)"
    r"(?:\.(?P<sae>hook_sae_[a-z_]+))?$"
)

# TransformerLens names whose value is the canonical site's on a pre-norm decoder whose blocks add each
# sublayer's output to the residual stream themselves (checked against HookedTransformer on GPT-2 and Llama).
TL_PRE_NORM = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "resid_post",
               "hook_mlp_out": "mlp", "hook_embed": "embed"}

_SAE = {"hook_sae_acts_post": "features", "hook_sae_acts_pre": "features", "hook_sae_recons": "recon",
        "hook_sae_error": "error", "hook_sae_input": ""}
_ATTN = {
    "hook_pattern": "facets.pattern ([batch, head, query, key], as TransformerLens)",
    "hook_attn_scores": "facets.scores ([batch, head, query, key], masked entries as the model's kernel masks them)",
    "hook_z": "facets.head_out ([batch, head, position, d_head]; TransformerLens: [batch, position, head, d_head])",
    "hook_q": "facets.q (as the attention kernel receives it: after rotary embeddings on rotary models, which is "
              "TransformerLens's hook_rot_q; [batch, head, position, d_head])",
    "hook_k": "facets.k (as the attention kernel receives it: after rotary embeddings, TransformerLens's hook_rot_k; "
              "[batch, n_kv_heads, position, d_head], not repeated for grouped-query attention)",
    "hook_v": "facets.v ([batch, n_kv_heads, position, d_head], not repeated for grouped-query attention)",
}
_ATTN["hook_rot_q"], _ATTN["hook_rot_k"] = _ATTN["hook_q"], _ATTN["hook_k"]


def is_transformerlens(name: str) -> bool:
    """Whether ``name`` (no ``:pass``) has the shape of a TransformerLens (or SAELens) hook name."""
    return TL_HOOK.match(name) is not None


def transformerlens_hint(name: str) -> str:
    """How TorchLens reads the value TransformerLens's ``name`` holds (one sentence, for the error)."""
    found = TL_HOOK.match(name)
    if found is None:
        return ""
    block, part, hook, sae = found["block"], found["part"], found["hook"], found["sae"]
    b = f"blocks.{block}" if block is not None else "blocks.L"
    if sae is not None:
        site = _canonical_spelling(b, part, hook)
        sub = _SAE.get(sae)
        if "hook_" in site:
            return (f"features= attaches a dictionary to one module's output of one tensor ({b}, {b}.resid_pre, "
                    f"{b}.mlp, or a real module path); no such site holds TransformerLens's {hook}")
        if sub == "":
            return f"SAELens's {sae} is the site's own value: trace[{site!r}].out"
        return (f"attach the SAE with tl.trace(model, x, features={{{site!r}: sae}}) and read "
                f"trace[{site + '.' + (sub or 'features')!r}].out")
    if part == "attn" and hook in _ATTN:
        return f"trace.find_sites(tl.module({b + '.attn'!r})).first().{_ATTN[hook]}"
    if part == "attn" and hook == "hook_result":
        return (f"per-head outputs after the output projection are not recorded: tl.decompose_resid(trace, "
                f"{int(block) + 1 if block is not None else 'L + 1'}, heads=True) gives each head's contribution "
                f"to the residual ('L{{i}}H{{h}}' rows)")
    if part in ("ln1", "ln2", "ln_final", "ln1_post", "ln2_post"):
        return ("norms are the model's own modules: read the norm's output by its real path (trace.modules); it is "
                "after the norm's weight and bias, while TransformerLens's hook_normalized is before them and "
                "hook_scale is the divisor (tl.accumulated_resid(trace, apply_ln=...) and "
                "tl.apply_ln_to_stack apply the final norm)")
    if part == "mlp":
        return ("the MLP's hidden activations are the output of its activation module, by its real path "
                f"(trace.modules under {b + '.mlp'!r})")
    if part == "unembed":
        return "the unembedding's output is trace.output.logits; its input is the final norm's output"
    if part is not None:
        return ""
    if hook == "hook_attn_out":
        return (f"trace[{b + '.attn'!r}].out[0] where the attention module returns its projected output (GPT-2, "
                "NeoX, Llama; a Hugging Face attention module returns a tuple); tl.arch(model).describe() shows which "
                "module blocks.L.attn is (BERT's is attention.self, before the output projection; Gemma norms the "
                "output before adding it, and TransformerLens's hook_attn_out is after that norm)")
    if hook == "hook_mlp_out":
        return (f"trace[{b + '.mlp'!r}].out is the MLP module's output; where a family norms it before adding it "
                "to the residual (Gemma's post_feedforward_layernorm) TransformerLens's hook_mlp_out is after "
                "that norm")
    if hook in ("hook_resid_mid", "hook_resid_post"):
        return (f"this family's {b}.{hook.removeprefix('hook_')} is not the tensor TransformerLens hooks there "
                "(on a post-norm block TransformerLens hooks the sum before the LayerNorm); "
                f"tl.arch(model).describe() shows what {b}.resid_mid / resid_post are here")
    if hook == "hook_resid_pre":
        return f"trace[{b + '.resid_pre'!r}].out"
    if hook in ("hook_mlp_in", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"):
        return (f"a sublayer's input is the residual before its norm: {b}.resid_pre for attention, "
                f"{b}.resid_mid for the MLP (TransformerLens repeats the *_input hooks along a head axis)")
    if hook == "hook_embed":
        return "trace['embed'].out (the token embedding module's output)"
    if hook == "hook_pos_embed":
        return ("trace['pos_embed'].out where the family has learned positions (GPT-2): shape [1, position, "
                "d_model] as the model computes it; TransformerLens broadcasts it to [batch, position, d_model]")
    if hook == "hook_tokens":
        return "the input ids you passed (trace.tokens with a tokenizer)"
    return ""


def _canonical_spelling(block: str, part: str | None, hook: str) -> str:
    """The TorchLens site an SAE hooked at TransformerLens's ``hook`` attaches to (``features=``)."""
    if part is None and hook == "hook_resid_post":
        return block
    if part is None and hook == "hook_resid_pre":
        return f"{block}.resid_pre"
    if part is None and hook == "hook_mlp_out":
        return f"{block}.mlp"
    return f"{block}.{part + '.' if part else ''}{hook}"
