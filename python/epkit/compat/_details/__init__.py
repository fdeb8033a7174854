"""What the drop-in modules of ``epkit.compat`` need but engines do not: scale-layout conversions, DeepEP's
configuration and event classes, byte counts, DeepGEMM's runtime settings and which of its names are provided."""
