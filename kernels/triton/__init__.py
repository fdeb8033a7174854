"""Triton kernels. Each module holds one op family's kernels and a launcher.

FP fusion (mul+add -> fma) is off by default here, so arithmetic kernels round
like their CPU references; set TRITON_DEFAULT_FP_FUSION=1 to opt back in.
"""

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
