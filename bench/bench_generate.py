"""``tl.generate`` against a plain ``generate`` (GPT-2 small, random weights, CPU one thread).

usage: python bench/bench_generate.py [--quick] [--fork] [--no-peers]  (--fork: the fork rows only)
A 16-token prompt, 32 new tokens, greedy. Cases, each a ratio to a plain ``model.generate`` timed
alternately in the same process:
- ``reads_3_blocks``: the outputs of three blocks at every step (``save=`` them, ``backend="hooks"``).
- ``every_op``: an every-op trace of every step.
- ``fork_step16``: ``gen.fork().do(tl.at_step(block, 16), edit)`` on ``transformer.h.6``: step 16 and the
  steps after it replayed from the parent's records (blocks 6-11 and the head run, blocks 0-5 read; the edit
  applied by a module hook at step 16) while the token is the parent's, regenerated for real (uncaptured,
  traces made when read) from the first token that differs; as a ratio to a fresh hooked ``generate`` with
  the same edit. Nearly all of a replayed step is the model's own compute: on one thread the head's weight
  (154 MB) is read once per step like those of 5.5 blocks, so a step from block 6 costs ~0.65 of a full
  one. ``_same_token``: a small edit, every token kept; ``_token_changes``: a large one, the token changes at step 17.
- peers, measured in the same run: ``nnsight`` 0.8 (``model.generate`` with ``tracer.all()`` reading
  the three blocks' outputs at every step; its edit: ``tracer.iter[16]`` setting block 6's output) and
  ``transformer_lens`` 3.9 (``HookedTransformer.generate`` on the same weights, converted with its own
  ``convert_gpt2_weights``, with hooks on ``blocks.{i}.hook_resid_post``; its edit: a hook counting
  calls). For the fork rows a peer has no replay: its edited generation is a fresh hooked
  ``generate``, timed as a ratio to the same plain hooked ``generate`` as TorchLens's fork.
- ``memory_256``: a 256-token generation with ``save=`` one block: the bytes its step traces hold
  (values and the model outputs they keep) next to what an unbounded every-op step holds.
Prints one JSON line per case.
"""

from __future__ import annotations

import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from common import emit, gpt2_small, measure, setup

import torchlens as tl  # noqa: E402
from torchlens.core.tree import flatten  # noqa: E402

BLOCKS = ["transformer.h.2", "transformer.h.6", "transformer.h.10"]


def hooked_generate(model, ids, address: str, vector: torch.Tensor, step: int, new: int):
    calls = [0]
    handles = [model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True),
               model.get_submodule(address).register_forward_hook(
                   lambda m, i, o: o + vector if calls[0] == step else None)]
    try:
        return model.generate(ids, max_new_tokens=new, do_sample=False)
    finally:
        for h in handles:
            h.remove()


def nnsight_peer(model):
    """nnsight's ``LanguageModel`` around a copy of ``model`` (nnsight instruments what it wraps)."""
    import copy

    import nnsight
    from bench_nnsight_shim import local_tokenizer  # a word-level tokenizer: no hub download

    return nnsight.LanguageModel(copy.deepcopy(model), tokenizer=local_tokenizer())


def nnsight_reads(lm, ids, new: int) -> list:
    """The three blocks' outputs at every step, as nnsight users write it."""
    import nnsight

    with lm.generate(ids, max_new_tokens=new, do_sample=False) as tracer:
        outs = nnsight.save([])
        for _ in tracer.all():
            outs.append([lm.transformer.h[int(b.rsplit(".", 1)[1])].output for b in BLOCKS])
    return outs


def nnsight_edited(lm, ids, new: int, layer: int, vector: torch.Tensor, step: int) -> torch.Tensor:
    """An edited generation in nnsight: ``vector`` added to block ``layer``'s output at ``step``, generated afresh."""
    with lm.generate(ids, max_new_tokens=new, do_sample=False) as tracer:
        for _ in tracer.iter[step]:
            lm.transformer.h[layer].output = lm.transformer.h[layer].output + vector
        out = tracer.result.save()
    return out


def lens_peer(model):
    """TransformerLens's ``HookedTransformer`` with ``model``'s weights (its own GPT-2 conversion)."""
    import warnings

    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = model.config
    cfg = HookedTransformerConfig(
        d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer, n_ctx=c.n_positions, eps=c.layer_norm_epsilon, d_vocab=c.vocab_size,
        act_fn=c.activation_function, normalization_type="LN", original_architecture="GPT2LMHeadModel",
        scale_attn_by_inverse_layer_idx=c.scale_attn_by_inverse_layer_idx, device="cpu", dtype=torch.float32)
    with warnings.catch_warnings():  # 3.9 announces HookedTransformer's removal in 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        hooked = HookedTransformer(cfg)
    hooked.load_state_dict(convert_gpt2_weights(model, cfg), strict=False)
    return hooked.eval()


def lens_generate(hooked, ids, new: int, hooks: list) -> torch.Tensor:
    with hooked.hooks(fwd_hooks=hooks):
        return hooked.generate(ids, max_new_tokens=new, do_sample=False, use_past_kv_cache=True, verbose=False,
                               stop_at_eos=False)


def lens_reads(hooked, ids, new: int) -> dict[str, list]:
    got: dict[str, list] = {b: [] for b in BLOCKS}
    hooks = [(f"blocks.{b.rsplit('.', 1)[1]}.hook_resid_post", lambda x, hook, b=b: got[b].append(x.detach()))
             for b in BLOCKS]
    lens_generate(hooked, ids, new, hooks)
    return got


def lens_edited(hooked, ids, new: int, layer: int, vector: torch.Tensor, step: int) -> torch.Tensor:
    calls = [0]

    def edit(x, hook):
        k, calls[0] = calls[0], calls[0] + 1  # the hook runs once per model call: call k is step k
        return x + vector if k == step else None

    return lens_generate(hooked, ids, new, [(f"blocks.{layer}.hook_resid_post", edit)])


def hf_reads(model, ids, new: int) -> dict[str, list]:
    """The reference reads: forward hooks on the blocks of a plain ``generate``."""
    got: dict[str, list] = {b: [] for b in BLOCKS}
    handles = [model.get_submodule(b).register_forward_hook(
        lambda m, i, o, b=b: got[b].append((o[0] if isinstance(o, tuple) else o).detach())) for b in BLOCKS]
    try:
        model.generate(ids, max_new_tokens=new, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return got


def peers_reads(model, ids, new: int, plain) -> None:
    want = hf_reads(model, ids, new)
    try:
        lm = nnsight_peer(model)
    except ImportError as err:
        emit("nnsight", "reads_3_blocks", None, 0.0, False, f"not measured: {err}")
    else:
        outs = nnsight_reads(lm, ids, new)
        ok = len(outs) == new and all(torch.equal(outs[k][j], want[b][k]) for k in range(new)
                                      for j, b in enumerate(BLOCKS))
        ms, base, ratio = measure(lambda: nnsight_reads(lm, ids, new), plain)
        emit("nnsight", "reads_3_blocks", ms, base, ok, "generate + tracer.all() saving 3 block outputs per step; "
             "ok: equal to forward hooks on a plain generate", ratio)
        del lm
    try:
        hooked = lens_peer(model)
    except ImportError as err:
        emit("transformer_lens", "reads_3_blocks", None, 0.0, False, f"not measured: {err}")
        return
    got = lens_reads(hooked, ids, new)
    first = all(torch.allclose(got[b][0], want[b][0], atol=1e-4) for b in BLOCKS)
    later = max(float((got[b][k] - want[b][k]).abs().max()) for b in BLOCKS for k in range(1, new))
    want_tokens = plain()
    tokens = torch.equal(lens_generate(hooked, ids, new, []), want_tokens)
    with hooked.hooks(fwd_hooks=[]):
        uncached = torch.equal(hooked.generate(ids, max_new_tokens=new, do_sample=False, use_past_kv_cache=False,
                                               verbose=False, stop_at_eos=False), want_tokens)
    ms, base, ratio = measure(lambda: lens_reads(hooked, ids, new), plain)
    emit("transformer_lens", "reads_3_blocks", ms, base, first and tokens,
         f"HookedTransformer.generate (its default KV cache) with 3 hook_resid_post hooks; ok: same tokens as HF "
         f"generate ({tokens}) and prompt-pass reads equal to 1e-4 ({first}); its cached steps' reads differ "
         f"from HF's by up to {later:.2g}; its uncached generate gives HF's tokens: {uncached}", ratio)


def peers_fork(model, ids, new: int, layer: int, vector: torch.Tensor, step: int, case: str, n: int) -> None:
    """A peer's edited generation (a fresh hooked generate) as a ratio to HF's hooked generate."""
    address = f"transformer.h.{layer}"
    want = hooked_generate(model, ids, address, vector, step, new)

    def base():
        return hooked_generate(model, ids, address, vector, step, new)

    for tool, build, edited in (("nnsight", nnsight_peer, nnsight_edited), ("transformer_lens", lens_peer,
                                                                            lens_edited)):
        try:
            peer = build(model)
        except ImportError as err:
            emit(tool, case, None, 0.0, False, f"not measured: {err}")
            continue
        ok = torch.equal(edited(peer, ids, new, layer, vector, step), want)  # also its warm-up
        if tool == "transformer_lens":  # ~5x a plain generate: one timed pair (base, then the peer)
            t0 = time.perf_counter()
            base()
            t1 = time.perf_counter()
            edited(peer, ids, new, layer, vector, step)
            t2 = time.perf_counter()
            ms, base_ms, ratio, reps = (t2 - t1) * 1000, (t1 - t0) * 1000, (t2 - t1) / (t1 - t0), 1
        else:
            ms, base_ms, ratio = measure(lambda peer=peer, edited=edited: edited(peer, ids, new, layer, vector, step),
                                         base, n=n)
            reps = n
        emit(tool, case, ms, base_ms, ok, f"no replay: a fresh generate with the edit at step {step}; "
             f"ratio to HF generate with the same edit by a hook ({reps} timed pair(s)); ok: same tokens as it",
             ratio)
        del peer


def held_bytes(steps) -> int:
    """Bytes of the tensors the step traces keep: saved op values, module outputs and model outputs."""
    seen: dict[int, int] = {}

    def add(value):
        for leaf in flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                seen[leaf.untyped_storage().data_ptr()] = leaf.untyped_storage().nbytes()

    for step in steps:
        for op in step.trace.ops:
            if op.saved and not op.is_input:
                add(op.out)
        add(step.trace.raw_output.logits)
    return sum(seen.values())


def main() -> None:
    setup()
    model, ids = gpt2_small()
    ids = ids[:, :16]
    new = 32

    def plain():
        return model.generate(ids, max_new_tokens=new, do_sample=False)

    fork_only = "--fork" in sys.argv
    if not fork_only:
        ms, base, ratio = measure(lambda: tl.generate(model, ids, max_new_tokens=new, do_sample=False, save=BLOCKS,
                                                      backend="hooks"), plain)
        emit("torchlens", "reads_3_blocks", ms, base, True, "save= 3 blocks, backend='hooks'; target <= 1.10", ratio)
        ms, base, ratio = measure(lambda: tl.generate(model, ids, max_new_tokens=new, do_sample=False), plain, n=3)
        emit("torchlens", "every_op", ms, base, True, "every op of every step; target <= 1.6", ratio)
        peers_reads(model, ids, new, plain)

    vector = torch.randn(768, generator=torch.Generator().manual_seed(0))
    gen = tl.generate(model, ids, max_new_tokens=new, do_sample=False)
    for scale, case in ((0.01, "fork_step16_same_token"), (40.0, "fork_step16_token_changes")):
        edit = tl.add(vector * scale)
        fork = gen.fork().do(tl.at_step("transformer.h.6", 16), edit)
        ok = torch.equal(fork.sequences, hooked_generate(model, ids, "transformer.h.6", vector * scale, 16, new))
        ms, base, ratio = measure(lambda edit=edit: gen.fork().do(tl.at_step("transformer.h.6", 16), edit),
                                  lambda scale=scale: hooked_generate(model, ids, "transformer.h.6", vector * scale,
                                                                      16, new), n=3 if "--quick" in sys.argv else 7)
        r = fork.record
        target = "0.35" if r.diverged_step is None else "0.7"
        emit("torchlens", case, ms, base, ok, f"{r.how}: replayed {len(r.replayed)}, regenerated "
                                              f"{len(r.regenerated)} step(s), diverged at step {r.diverged_step}; "
                                              f"ratio to a fresh hooked generate, target <= {target}", ratio)
        if "--no-peers" not in sys.argv:
            peers_fork(model, ids, new, 6, vector * scale, 16, case, n=3 if "--quick" in sys.argv else 7)
    if fork_only:
        return

    bounded = tl.generate(model, ids, max_new_tokens=240, do_sample=False, save="transformer.h.6")
    one_step = tl.generate(model, ids, max_new_tokens=2, do_sample=False)
    emit("torchlens", "memory_256", None, 0.0, True,
         f"256-token generation, save= one block: step traces hold {held_bytes(bounded.steps) / 2**20:.1f} MiB "
         f"(of which logits {sum(s.logits.nbytes for s in bounded.steps) / 2**20:.1f} MiB); one unbounded "
         f"one-token step holds {held_bytes(one_step.steps[1:]) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
