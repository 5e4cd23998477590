"""A conformance kit for architecture support packages and capture engines.

A package that teaches TorchLens a model family (an adapter, an engine, facets) runs
:func:`check_model` on its model classes in its own CI: capture bit-equal to a plain forward,
the model left as it was, ``tl.validate`` OK, a replayed edit equal to a forward hook doing the
same edit, each declared canonical site found and passing its structural checks
(``torchlens.arch.check_layout``), and attention facets exact where the sites declare them.
With pytest, ``pytest_plugins = ("torchlens.testing.pytest_plugin",)`` in a ``conftest.py``
gives the ``torchlens_conformance`` fixture. ``docs/plugins.md`` walks through a template package.
"""

from ._conformance import CheckResult, ConformanceReport, check_model

__all__ = ["CheckResult", "ConformanceReport", "check_model"]
