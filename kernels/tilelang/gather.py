"""TileLang row gather: ``out[i] = x[index[i]]``, zero rows where ``index[i] == -1``.

One factory serves both dialects. Rows move as integer words (the C target has
no bfloat16), so the copy is bit-exact for every dtype.
``python bench/kernel_check.py gather --backend tilelang`` checks and times it.
"""

import functools

import torch

from epkit.kernels.tilelang.build import build_c, build_cuda, language, run_rows_parallel

_WORD = {torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.uint8: "uint8"}


def gather_rows_func(num_words: int, word: str = "int32", dialect: str = "cpu"):
    """The prim_func: ``x [N, W] word``, ``index [M] int32``, ``out [M, W] word``; N and M are runtime sizes."""
    T, kernel_kw = language(dialect)
    n = T.dynamic("N")
    m = T.dynamic("M")

    @T.prim_func
    def gather_rows_kernel(
        x: T.Tensor((n, num_words), word),
        index: T.Tensor((m,), "int32"),
        out: T.Tensor((m, num_words), word),
    ):
        with T.Kernel(m, **kernel_kw) as i:
            src = index[i]
            if src >= 0:
                for j in T.Parallel(num_words):
                    out[i, j] = x[src, j]
            else:
                for j in T.Parallel(num_words):
                    out[i, j] = T.cast(0, word)

    return gather_rows_kernel


@functools.cache
def _kernel(num_words: int, word: str, device_type: str):
    func = gather_rows_func(num_words, word, "cpu" if device_type == "cpu" else "cuda")
    return build_c(func) if device_type == "cpu" else build_cuda(func)


def _call(kernel, x, index, out):
    return lambda k, s, e: k(x, index[s:e], out[s:e])


def gather_rows_words(x_words: torch.Tensor, index: torch.Tensor, out_words: torch.Tensor) -> None:
    """Launch on word views: ``x_words [N, W]``, ``index [M]`` (int32 or int64, values in [-1, N)), ``out [M, W]``."""
    m, w = out_words.shape
    if m == 0 or w == 0:
        return
    index = index.to(torch.int32)
    kernel = _kernel(w, _WORD[x_words.dtype], x_words.device.type)
    if x_words.device.type == "cpu":
        run_rows_parallel(kernel, m, _call(kernel, x_words, index, out_words))
    else:
        kernel(x_words, index, out_words)
