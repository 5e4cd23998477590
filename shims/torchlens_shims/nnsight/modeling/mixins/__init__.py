"""nnsight's ``nnsight.modeling.mixins``: the base classes for writing your own model wrapper.

`Loadable` builds its module from whatever identifies it (``_load``); `Meta` builds it on
the meta device first (``_load_meta``) and loads real weights on the first run
(``dispatch()``). `Remotable` (NDIF placement) is refused.
"""

from __future__ import annotations

__all__: list[str] = []
