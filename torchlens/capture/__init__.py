"""Capture engines: how a real eager forward is observed and edited while it runs.

``hooks`` (module hooks, public: the shims build on it), ``request`` (what an engine is asked),
``engines`` (the built-in engines, registered as plugins); the recorder is private.
"""

__all__: list[str] = []
