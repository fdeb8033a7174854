"""TileLang kernels: one factory per kernel, parameterised by dialect ("cpu" or "cuda").

The CPU dialect compiles with the C target and runs on CPU tensors; the CUDA
dialect runs on GPU tensors and is lowered for sm_90 in CI without a GPU.
"""

import os

os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
