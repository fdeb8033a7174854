"""``epkit bench``: one benchmark harness for every op family, each figure beside a peer or roof of the same run.

Every case times its contenders in interleaved rounds (each round calls every contender once, in a seeded
random order, after a warm-up), so that load from other processes hits all of them alike; a row reports the
median with min/max, the throughput, the fraction of its roof and the speed ratio to its peer, both as the
median of per-round ratios. On a GPU each sample is bracketed by CUDA events, and the GEMMs flush L2 first.

Modules: :mod:`~epkit.bench.timing` (how a call is timed; also used by ``bench/gpu_check.py``),
:mod:`~epkit.bench.core` (the run context, rows, peers and roofs), :mod:`~epkit.bench.runner` (families in
turn, with a progress bar and a time budget), :mod:`~epkit.bench.report` (the Markdown table and the JSON
document), :mod:`~epkit.bench.compare` (two runs of one machine kind), :mod:`~epkit.bench.plots`
(matplotlib charts), :mod:`~epkit.bench.cli` (``epkit bench``), and one module per op family, named as
in :data:`FAMILIES`.
"""

__all__ = ["FAMILIES"]

#: The op families, in the order a run takes them; each is the module ``epkit.bench.<name>``.
FAMILIES = (
    "gather",
    "cp_mirror",
    "engram",
    "experts",
    "grouped_gemm",
    "ep_buffer",
    "engram_table",
    "model",
    "ep_hosts",
)
