"""``tl.debug``: comparing two traces or forks op by op (``tl.debug.compare(a, b)``).

The implementation lives in :mod:`torchlens.analysis.compare`; this module is the public name.
"""

from .analysis.compare import Comparison, Diff, compare

__all__ = ["Comparison", "Diff", "compare"]
