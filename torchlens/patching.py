"""``tl.patching``: activation patching grids, causal tracing (ROME), attribution patching, over features too.

The implementations live in :mod:`torchlens.analysis.patching` (exact patching on sliced
replay), :mod:`torchlens.analysis.patching_attribution` and
:mod:`torchlens.analysis.patching_lens`, over feature dictionaries :mod:`torchlens.features.patching`;
this module is the public name. See docs/patching.md and docs/features-workflows.md.
"""

from .analysis.patching import (
    KINDS,
    MetricReads,
    PatchingResult,
    activation_patching,
    causal_trace,
    logit_diff,
    prob,
    restore_rows,
)
from .analysis.patching_attribution import attribution_patching
from .analysis.patching_lens import LogitLens, logit_lens
from .features.patching import feature_attribution_patching, feature_patching

__all__ = [
    "KINDS", "LogitLens", "MetricReads", "PatchingResult", "activation_patching", "attribution_patching",
    "causal_trace", "logit_diff", "logit_lens", "prob", "restore_rows",
]
__all__ += ["feature_attribution_patching", "feature_patching"]
