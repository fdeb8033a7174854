"""Drop-in interfaces of the libraries engines already call, on epkit's ops: switch by one import line.

``epkit.compat.deep_ep``
    DeepEP's legacy ``Buffer`` (intranode, internode and low-latency modes), ``Config``, ``EventOverlap``,
    ``EventHandle``, ``topk_idx_t``, over :class:`epkit.collectives.ep_buffer.EPBuffer`.
``epkit.compat.deep_gemm``
    DeepGEMM's grouped and dense GEMMs, layout helpers and runtime settings, over :mod:`epkit.grouped_gemm`, and
    its ``utils`` (the casts to FP8 / FP4) and ``testing`` submodules.
``epkit.compat.eplb``
    DeepSeek's EPLB (``rebalance_experts`` and its steps), over :mod:`epkit.eplb`.

Each module takes its library's names, parameter names and order, defaults, return arity and tensor layouts. A
call epkit cannot serve raises ``TypeError`` or ``ValueError`` naming the library's parameter and saying what
epkit supports; nothing is bound to another parameter. Tuning arguments that change no result here (DeepEP's
``config``, DeepGEMM's ``compiled_dims``, ...) are checked and accepted; each module's docstring (and
``deep_ep.Buffer``'s) lists them. bench/README.md ("Drop-in interfaces: supported and refused") has the table of
what each module supports and refuses.

The modules are imported on demand (``import epkit.compat.deep_ep``): ``import epkit`` does not load them.
"""
