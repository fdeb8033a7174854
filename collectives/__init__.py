"""Collectives of epkit (package ``epkit.collectives``): CP communication, symmetric memory, dispatch/combine."""
