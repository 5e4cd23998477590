"""TorchLens: read, edit, replay and compare the activations of real PyTorch models.

``tl.trace(model, x)`` records every op of one eager forward; ``tl.extract`` reads module
outputs with hooks alone; ``trace.fork().do(site, edit)`` edits after the fact by replaying
the recorded graph; ``tl.when`` edits during capture; ``tl.validate`` checks a capture.
"""

import sys
from importlib.metadata import PackageNotFoundError, version

from . import errors, features, patching
from ._core_services import install_services
from .analysis import compare as debug  # tl.debug: two traces compared op by op
from .analysis import display as _display  # noqa: F401  (provides Trace.table: core.actions)
from .analysis import facets as _facets  # noqa: F401  (provides Site.facets: core.actions)
from .analysis import heads as mechinterp  # tl.mechinterp: attention-head patching
from .analysis import notebook as _notebook  # noqa: F401  (every object's notebook HTML: core.repr_html)
from .analysis import plots
from .analysis import summary as _summary  # noqa: F401  (provides Trace.summary, to_pandas: core.actions)
from .analysis.draw import Drawing, draw
from .analysis.logit_lens import logit_lens
from .analysis.residual import accumulated_resid
from .analysis.residual_decompose import ResidualStack, apply_ln_to_stack, decompose_resid, logit_attrs
from .api import extract, trace
from .arch import arch
from .core.builder import TraceBuilder
from .core.fork import Fork
from .core.records import ModuleCall, Op
from .core.selectors import Selector, func, in_module, module
from .core.sites import Site, Sites
from .core.steps import Step
from .core.trace import Trace
from .edit.edits import AppliedEdit, EditContext, When, when
from .edit.helpers import Helper, add, mean_ablate, noise, patch_from, register_helper, scale, zero_ablate
from .edit.validate import ValidationReport, validate
from .errors import (
    AmbiguousSiteError,
    EditHadNoEffect,
    EditHadNoEffectError,
    EditNotAppliedError,
    EditShapeError,
    EmptySelectionError,
    FusedKernelError,
    LayoutInferenceError,
    LegacyArgumentError,
    OutOfOrderError,
    RecipeFormatError,
    ReplayNotExactError,
    SiteNotFoundError,
    TorchLensError,
    UnsupportedModelError,
)
from .features.stats import FeatureStats, feature_stats, load_feature_stats
from .generation import GenerationFork, GenerationStep, GenerationTrace, at_step, generate
from .plugins import plugins
from .store.datasets import ActivationDataset, cache_activations, load_activations, map_dataset
from .store.recipes import Recipe, load_intervention
from .store.traces import load_trace

install_services()  # traces reach replay, re-execution and model names through these
# Trace's other methods (validate, save, save_intervention, table, to_dot, draw, summary, to_pandas) and
# Site.facets are added by the modules above that own them, on import (core.actions.provide_methods).

# ``tl.debug`` and ``tl.mechinterp`` are the modules that implement them, under a public name: registered
# here so ``import torchlens.debug`` and ``from torchlens.mechinterp import patch_head`` find them
# without an alias file at the top (``tl.patching`` is a package: it gathers several modules).
sys.modules.update({f"{__name__}.debug": debug, f"{__name__}.mechinterp": mechinterp})

try:
    __version__ = version("torchlens")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "ActivationDataset",
    "AmbiguousSiteError",
    "AppliedEdit",
    "EditContext",
    "EditHadNoEffect",
    "EditHadNoEffectError",
    "EditNotAppliedError",
    "Drawing",
    "EditShapeError",
    "EmptySelectionError",
    "FeatureStats",
    "Fork",
    "FusedKernelError",
    "GenerationFork",
    "GenerationStep",
    "GenerationTrace",
    "Helper",
    "LayoutInferenceError",
    "LegacyArgumentError",
    "ModuleCall",
    "Op",
    "OutOfOrderError",
    "Recipe",
    "RecipeFormatError",
    "ReplayNotExactError",
    "ResidualStack",
    "Selector",
    "Site",
    "SiteNotFoundError",
    "Sites",
    "Step",
    "TorchLensError",
    "Trace",
    "TraceBuilder",
    "UnsupportedModelError",
    "ValidationReport",
    "When",
    "__version__",
    "accumulated_resid",
    "add",
    "apply_ln_to_stack",
    "arch",
    "at_step",
    "cache_activations",
    "debug",
    "decompose_resid",
    "draw",
    "errors",
    "extract",
    "feature_stats",
    "features",
    "func",
    "generate",
    "in_module",
    "load_activations",
    "load_feature_stats",
    "load_intervention",
    "load_trace",
    "logit_attrs",
    "logit_lens",
    "map_dataset",
    "mean_ablate",
    "mechinterp",
    "module",
    "noise",
    "patch_from",
    "patching",
    "plots",
    "plugins",
    "register_helper",
    "scale",
    "trace",
    "validate",
    "when",
    "zero_ablate",
]
