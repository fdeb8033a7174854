"""The sections of ``bench/gpu_check.py``, one module per op family, and what they share (``common``).

Not an installed package: ``python bench/gpu_check.py`` puts ``bench/`` on ``sys.path`` (and gpu_check.py
does so itself when loaded by path), so these import as ``gpu_sections.<module>``.
"""
