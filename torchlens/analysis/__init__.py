"""Reading a trace: attention facets (``facets``), head patching (``heads``), trace comparison
(``compare``) and text tables (``display``)."""

__all__: list[str] = []
