"""Generation, first-class: ``tl.generate`` records each step of a real generation as a trace.

``tl.generate(model, ids, max_new_tokens=8)`` runs the model's own ``generate`` (or your decoding
loop, ``loop=fn``) and captures every call of the model's forward as one step; sites address
steps with ``tl.at_step(site, k | range | list)`` (a plain site: every step), and edits given to
``intervene=`` apply during generation, at the steps they name.
"""

from .run import generate
from .sites import AtStep, at_step
from .trace import GenerationStep, GenerationTrace, StepList

__all__ = ["AtStep", "GenerationStep", "GenerationTrace", "StepList", "at_step", "generate"]
