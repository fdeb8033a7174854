"""Errors name what the caller passed: the argument (``w2``, ``x``, ``ngram_token_ids``) or the variable
(``EPKIT_BACKEND``), never an internal operand name such as the GEMM's ``a``/``b``."""

import pytest
import torch

import epkit
from epkit.backends import BackendUnavailableError, backend_info, select
from epkit.grouped_gemm import build_m_indices
from epkit.quant import cast_to_mxfp4, per_block_cast_to_fp8

G, H, I = 2, 256, 128


def _weights(fmt: str, w13_shape=(G, 2 * I, H), w2_shape=(G, H, I)):
    make = {"fp8": per_block_cast_to_fp8, "fp8_fp4": cast_to_mxfp4, "bf16": lambda w: w.bfloat16()}[fmt]
    return make(torch.randn(*w13_shape) / 16), make(torch.randn(*w2_shape) / 11)


def _mlp(hidden, w13, w2):
    m_indices = build_m_indices([100, 20])  # [256]: group 0's 100 rows, group 1's 20, padding
    return epkit.expert_mlp(torch.randn(m_indices.numel(), hidden), "contiguous", w13, w2, m_indices=m_indices)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_fp4", "bf16"])
@pytest.mark.parametrize(
    "w2_shape",
    [(G, H, 2 * I), (G, I, H), (G, 2 * H, I), (G + 1, H, I)],
    ids=["I-doubled", "transposed", "H-doubled", "G-differs"],
)
def test_expert_mlp_blames_a_bad_w2(fmt, w2_shape):
    w13, w2 = _weights(fmt, w2_shape=w2_shape)
    with pytest.raises(ValueError, match=r"^w2 must be \[G, H, I\] = \(2, 256, (128|64)\)") as exc:
        _mlp(H, w13, w2)
    assert " b " not in str(exc.value) and "b must" not in str(exc.value)


def test_expert_mlp_blames_x_or_w13_for_a_hidden_size_mismatch():
    w13, w2 = _weights("fp8")
    with pytest.raises(ValueError, match=r"^x must have hidden size H = 256 .*got \(256, 384\)"):
        _mlp(384, w13, w2)
    with pytest.raises(ValueError, match=r"^w13 must be \[G, 2\*I, H\]"):
        _mlp(H, per_block_cast_to_fp8(torch.randn(G, 2 * I - 128 + 1, H)), w2)


def test_expert_mlp_names_its_argument_when_a_gemm_rejects_one():
    w13, w2 = _weights("fp8")
    bad_scales = (w2[0], w2[1][:, :1])  # w2's body is right, its scales are not
    with pytest.raises(ValueError, match=r"^expert_mlp: the down GEMM .*b = w2.*: sfb must have shape"):
        _mlp(H, w13, bad_scales)


def test_engram_hash_blames_ids_of_the_wrong_width():
    cfg = epkit.EngramConfig(vocab_size=1000, ngram_vocab_sizes=(5000, 7000), n_head_per_ngram=2, layer_ids=(0,))
    params = epkit.hash_params(cfg)  # N = max_ngram_size = 3
    ids = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^ngram_token_ids has N = 4 columns.*must be \[T, 3\], got \(4, 4\)"):
        epkit.engram_hash(ids, *params)
    assert epkit.engram_hash(ids[:, :3], *params).shape == (1, 4, 4)


def test_a_forced_backend_names_epkit_backend(monkeypatch):
    monkeypatch.setenv("EPKIT_BACKEND", "tilelang")
    # an op without that backend
    with pytest.raises(
        ValueError, match=r"^EPKIT_BACKEND=tilelang: m_grouped_fp8_gemm_nt_contiguous has no 'tilelang'"
    ):
        select("m_grouped_fp8_gemm_nt_contiguous", "cpu")
    with pytest.raises(ValueError, match="unset it \\(or set it to auto\\)"):
        select("m_grouped_fp8_gemm_nt_contiguous", "cpu")
    # a backend that cannot run on these tensors here: CUDA tensors without a GPU (or a name that is no backend)
    monkeypatch.setenv("EPKIT_BACKEND", "magic")
    with pytest.raises(ValueError, match=r"^EPKIT_BACKEND=magic: unknown backend 'magic'"):
        select("gather_rows", "cpu")
    if not backend_info("triton").available_on("cuda"):
        monkeypatch.setenv("EPKIT_BACKEND", "triton")
        with pytest.raises(BackendUnavailableError, match=r"^EPKIT_BACKEND=triton: gather_rows: backend 'triton'"):
            select("gather_rows", "cuda")
    # an explicit backend= is the caller's own choice: the message does not mention the variable
    monkeypatch.setenv("EPKIT_BACKEND", "cpu")
    with pytest.raises(ValueError) as exc:
        select("m_grouped_fp8_gemm_nt_contiguous", "cpu", "tilelang")
    assert "EPKIT_BACKEND" not in str(exc.value)
