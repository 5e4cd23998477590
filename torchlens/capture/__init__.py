"""Capture engines: how a real eager forward is observed and edited while it runs."""
