"""TileLang ``prepare_cp_mirror``: the zigzag CP index math, one program per sequence.

Inputs are per-sequence prefix sums computed on the host (first query token,
query length, cached prefix, first mirror slot, first compressed key per
ratio); every per-token index (mirror slot -> token, token -> gathered
position, key ranges per ratio) is computed here. Sizes (sequences, slots,
tokens, ratios) and ``cp_size`` / ``cp_rank`` are runtime values, so one
compiled kernel serves every batch. One factory serves both dialects.
``python bench/kernel_check.py cp_mirror --backend tilelang`` checks it against the
reference and times it.
"""

import functools

import torch

from epkit.kernels.tilelang.build import build_c, build_cuda, language, run_rows_parallel


def prepare_cp_mirror_func(dialect: str = "cpu", chunk: int = 128):
    """The prim_func; ``params = [cp_size, cp_rank, cp_mirror_len]`` (int32 [3]).

    Per sequence (``B``): ``q_start``, ``q_len``, ``prefix``, ``mirror_off`` int32 [B], ``key_start`` int32 [B, R];
    ``ratios`` int32 [R]. Outputs: ``index`` int32 [L], ``reverse`` int32 [TQ], ``ks`` / ``ke`` int32 [R, L].
    Outputs are addressed absolutely, so a call may cover any contiguous range of sequences.
    """
    T, kernel_kw = language(dialect)
    nb = T.dynamic("B")
    nl = T.dynamic("L")
    nt = T.dynamic("TQ")
    nr = T.dynamic("R")

    @T.prim_func
    def prepare_cp_mirror_kernel(
        q_start: T.Tensor((nb,), "int32"),
        q_len: T.Tensor((nb,), "int32"),
        prefix: T.Tensor((nb,), "int32"),
        mirror_off: T.Tensor((nb,), "int32"),
        key_start: T.Tensor((nb, nr), "int32"),
        ratios: T.Tensor((nr,), "int32"),
        params: T.Tensor((3,), "int32"),
        index: T.Tensor((nl,), "int32"),
        reverse: T.Tensor((nt,), "int32"),
        ks: T.Tensor((nr, nl), "int32"),
        ke: T.Tensor((nr, nl), "int32"),
    ):
        with T.Kernel(nb, **kernel_kw) as b:
            # Per-sequence scalars live in registers (the outputs may alias the inputs as far as C knows).
            # Every operand is non-negative, so C division (truncdiv) equals floor division.
            cp_size = T.alloc_var("int32", init=params[0])
            cp_rank = T.alloc_var("int32", init=params[1])
            mirror_len = T.alloc_var("int32", init=params[2])
            first = T.alloc_var("int32", init=q_start[b])
            sq = T.alloc_var("int32", init=q_len[b])
            pre = T.alloc_var("int32", init=prefix[b])
            off = T.alloc_var("int32", init=mirror_off[b])
            ps = T.alloc_var("int32", init=T.truncdiv(q_len[b] + 2 * params[0] - 1, 2 * params[0]))
            num_chunks = T.alloc_var("int32", init=T.truncdiv(ps + chunk - 1, chunk))
            # Mirror slots: half 0 holds block cp_rank, half 1 block 2*cp_size-1-cp_rank; slot j of a half
            # holds position ps*blk + j of the sequence, or padding past its end.
            for half in T.serial(2):
                blk = cp_rank + half * (2 * cp_size - 1 - 2 * cp_rank)
                for it in T.serial(num_chunks):
                    for t in T.Parallel(chunk):
                        j = it * chunk + t
                        if j < ps:
                            pos = ps * blk + j
                            slot = off + half * ps + j
                            if pos < sq:
                                index[slot] = first + pos
                                for r in T.serial(nr):
                                    ks[r, slot] = key_start[b, r]
                                    ke[r, slot] = key_start[b, r] + T.truncdiv(pre + pos + 1, ratios[r])
                            else:
                                index[slot] = -1
                                for r in T.serial(nr):
                                    ks[r, slot] = key_start[b, r]
                                    ke[r, slot] = key_start[b, r]
            # Reverse index: block blk (first < cp_size: half 0 of rank blk; else half 1 of rank 2*cp_size-1-blk)
            # lands at owner * cp_mirror_len + mirror_off + half * ps in the rank-major gathered buffer.
            for blk in T.serial(2 * cp_size):
                second = T.truncdiv(blk, cp_size)
                owner = blk + second * (2 * cp_size - 1 - 2 * blk)
                for it in T.serial(num_chunks):
                    for t in T.Parallel(chunk):
                        j = it * chunk + t
                        if j < ps and ps * blk + j < sq:
                            reverse[first + ps * blk + j] = owner * mirror_len + off + second * ps + j

    return prepare_cp_mirror_kernel


@functools.cache
def _kernel(device_type: str):
    func = prepare_cp_mirror_func("cpu" if device_type == "cpu" else "cuda")
    return build_c(func) if device_type == "cpu" else build_cuda(func)


def prepare_cp_mirror_launch(
    q_start, q_len, prefix, mirror_off, key_start, ratios, cp_size, cp_rank, index, reverse, ks, ke
) -> None:
    """Fill ``index [L]``, ``reverse [TQ]``, ``ks`` / ``ke [R, L]`` (int32) from the per-sequence inputs."""
    device = index.device
    params = torch.tensor([cp_size, cp_rank, index.numel()], dtype=torch.int32, device=device)
    kernel = _kernel(device.type)
    num_seqs = q_len.numel()
    if device.type != "cpu":
        kernel(q_start, q_len, prefix, mirror_off, key_start, ratios, params, index, reverse, ks, ke)
        return

    def call(k, s, e):
        k(
            q_start[s:e],
            q_len[s:e],
            prefix[s:e],
            mirror_off[s:e],
            key_start[s:e],
            ratios,
            params,
            index,
            reverse,
            ks,
            ke,
        )

    # Sequences are independent and outputs are addressed absolutely: split sequences across threads.
    run_rows_parallel(kernel, num_seqs, call, min_rows_per_thread=8)
