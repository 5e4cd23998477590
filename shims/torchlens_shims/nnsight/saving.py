"""``save``: the public home of nnsight's ``save`` function (``nnsight.tracing.tracer.save``).

The machinery (marks, nesting depth, ``object.save``) is `_saving`; this module is what a
path-for-path port of ``from nnsight.tracing.tracer import save`` reaches.
"""

from __future__ import annotations

from ._saving import save

__all__ = ["save"]
