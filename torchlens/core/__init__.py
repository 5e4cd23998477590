"""Plain data for one recorded run: records, traces and forks, selectors, sites, steps.

Imports nothing above ``torchlens.core`` (errors aside). Replay and re-execution, which live
above it, are reached through :mod:`torchlens.core.services`; the other methods of a trace that
live above it (validate, save, draw ...) are added by their owning packages on import
(:func:`torchlens.core.actions.provide_methods`), and notebook HTML is one lookup the notebook
package fills (:mod:`torchlens.core.repr_html`).
"""

__all__: list[str] = []
