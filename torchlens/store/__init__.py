"""Everything that reads or writes disk: saved traces (``traces``), ``.tlspec/`` recipes
(``recipes``) and their private codecs, checks and file formats (``_*`` modules)."""

__all__: list[str] = []
