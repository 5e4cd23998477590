"""Feature dictionaries (SAEs, transcoders) as capture sees them: wrapped, loaded, spliced at a site.

The capture-facing half of features, below ``api`` in the package order: ``tl.trace(model, x,
features={site: sae})`` splices each dictionary in while capturing (:mod:`.attach`), so ``api`` imports
this package, and what reads, edits and summarises features over traces (``torchlens.features``, which
captures through ``api``) sits above it. Users reach every name here as ``tl.features.<name>``.
"""

from .attach import FeatureAttachment, FeatureSplice, attach, dictionaries
from .load import SavedSAE, load_sae
from .wrap import FeatureDictionary, as_dictionary

__all__ = ["FeatureAttachment", "FeatureDictionary", "FeatureSplice", "SavedSAE", "as_dictionary", "attach",
           "dictionaries", "load_sae"]
