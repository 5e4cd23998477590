"""The conformance kit as a pytest plugin: the ``torchlens_conformance`` fixture.

Load it from a ``conftest.py`` with ``pytest_plugins = ("torchlens.testing.pytest_plugin",)``;
then ``torchlens_conformance(model, inputs, **options)`` runs :func:`torchlens.testing.check_model`
and fails the test with every check listed when one fails (returning the report otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ._conformance import ConformanceReport, check_model

__all__ = ["torchlens_conformance"]


@pytest.fixture
def torchlens_conformance() -> Callable[..., ConformanceReport]:
    """``check(model, inputs, **options)``: :func:`torchlens.testing.check_model`, asserting it is OK."""

    def check(model: Any, inputs: Any, **options: Any) -> ConformanceReport:
        report = check_model(model, inputs, **options)
        if not report.ok:
            pytest.fail(report.summary(), pytrace=False)
        return report

    return check
