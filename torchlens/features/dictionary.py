"""The former home of the dictionary wrapper and the SAELens reader, now ``torchlens.dictionaries``.

``from torchlens.features.dictionary import SavedSAE`` (and ``FeatureDictionary``, ``as_dictionary``,
``load_sae``) keeps working, as do ``SavedSAE`` objects pickled under this path; new code imports
``tl.features.<name>`` or ``torchlens.dictionaries``.
"""

from ..dictionaries.load import SavedSAE, load_sae
from ..dictionaries.wrap import FeatureDictionary, as_dictionary

__all__ = ["FeatureDictionary", "SavedSAE", "as_dictionary", "load_sae"]
