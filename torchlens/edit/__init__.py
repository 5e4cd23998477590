"""Edits: what an edit is (``edits``), the named helpers (``helpers``), replay of an edit on a
fork (``replay``) and ``tl.validate`` (``validate``)."""

__all__: list[str] = []
