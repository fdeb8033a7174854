"""GPU probe (run on the H200 after the scale fix): FP8 per-token-group and per-block quantization, CUDA
against CPU, bit for bit. Needs a CUDA device; prints, asserts nothing (the GPU tests assert the same equality
through the low-latency dispatch)."""

import torch

from epkit.quant import cast_groups_to_fp8, per_block_cast_to_fp8

g = torch.Generator().manual_seed(0)
x = (torch.randn(4096, 1024, generator=g) * 3).bfloat16()
for name, fn in (("per-token-group", cast_groups_to_fp8), ("per-block", per_block_cast_to_fp8)):
    qc, sc = fn(x)
    qg, sg = fn(x.cuda())
    same_q = torch.equal(qc.view(torch.uint8), qg.cpu().view(torch.uint8))
    print(name, "scales equal", torch.equal(sc, sg.cpu()), "codes equal", same_q)
