"""Internals of epkit.collectives, split out of the public modules to keep each file readable."""
