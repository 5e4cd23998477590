"""Plain data for one recorded run: records, traces and forks, selectors, sites, steps.

Imports nothing above ``torchlens.core`` (errors aside); work that lives above it is reached
through :mod:`torchlens.core.services`.
"""

__all__: list[str] = []
