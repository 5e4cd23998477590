"""Generation, first-class: ``tl.generate`` records each step of a real generation as a trace.

``tl.generate(model, ids, max_new_tokens=8)`` runs the model's own ``generate`` (or your decoding
loop, ``loop=fn``) and captures every call of the model's forward as one step; sites address
steps with ``tl.at_step(site, k | range | list)`` (a plain site: every step), edits given to
``intervene=`` apply during generation, at the steps they name, and ``gen.fork().do(site, edit)``
edits a finished generation: the steps after the edit are replayed from its records while their
tokens stay the same, and regenerated for real from the first token that differs.
"""

from .compare import GenerationComparison
from .fork import ForkRecord
from .run import generate
from .sites import AtStep, at_step
from .trace import GenerationFork, GenerationStep, GenerationTrace, StepList

__all__ = ["AtStep", "ForkRecord", "GenerationComparison", "GenerationFork", "GenerationStep", "GenerationTrace",
           "StepList", "at_step", "generate"]
