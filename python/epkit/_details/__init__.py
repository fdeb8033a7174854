"""Internals of epkit, split out of the public modules to keep each file readable."""
