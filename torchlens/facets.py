"""Facet plugin for fused attention (being written)."""

FacetPlugin = None
