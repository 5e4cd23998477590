"""``tl.generate`` against a plain ``generate`` (GPT-2 small, random weights, CPU one thread).

usage: python bench/bench_generate.py [--quick] [--fork]  (--fork: the fork rows only)
A 16-token prompt, 32 new tokens, greedy. Cases, each a ratio to a plain ``model.generate`` timed
alternately in the same process:
- ``reads_3_blocks``: the outputs of three blocks at every step (``save=`` them, ``backend="hooks"``).
- ``every_op``: an every-op trace of every step.
- ``fork_step16``: ``gen.fork().do(tl.at_step(block, 16), edit)`` on ``transformer.h.6``: step 16 and the
  steps after it replayed from the parent's records (blocks 6-11 and the head run, blocks 0-5 read; the edit
  applied by a module hook at step 16) while the token is the parent's, regenerated for real (uncaptured,
  traces made when read) from the first token that differs; as a ratio to a fresh hooked ``generate`` with
  the same edit. Nearly all of a replayed step is the model's own compute: on one thread the head's weight
  (154 MB) is read once per step like those of 5.5 blocks, so a step from block 6 costs ~0.65 of a full one. ``_same_token``: a small edit, every token kept; ``_token_changes``:
  a large one, the token changes at step 17.
- ``memory_256``: a 256-token generation with ``save=`` one block: the bytes its step traces hold
  (values and the model outputs they keep) next to what an unbounded every-op step holds.
Prints one JSON line per case.
"""

from __future__ import annotations

import sys  # noqa: E402

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
