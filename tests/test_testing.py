"""The comparison helpers of epkit.testing."""

import pytest
import torch

from epkit.testing import assert_bitwise_equal, assert_diff, calc_diff


def test_calc_diff_values():
    x = torch.randn(1000, dtype=torch.float64)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, 2 * x) == pytest.approx(1 - 4 / 5)  # 1 - 2*2/(1+4)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        calc_diff(torch.zeros(2), torch.zeros(3))


def test_assert_diff():
    x = torch.randn(256)
    assert assert_diff(x + 1e-4 * torch.randn(256), x, 1e-6, ctx="ok") < 1e-6
    with pytest.raises(AssertionError, match=r"case=7: calc_diff"):
        assert_diff(x + 1.0, x, 1e-3, ctx="case=7")
    with pytest.raises(AssertionError, match="NaN or Inf"):
        assert_diff(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0)


def test_bitwise_equal_sees_signed_zero_and_nan_payload():
    a = torch.tensor([0.0, 1.0])
    assert_bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError, match=r"m=3: 1 of 2 elements differ; first at \(0,\)"):
        assert_bitwise_equal(torch.tensor([-0.0, 1.0]), a, ctx="m=3")
    nan1 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(nan1, nan2)
    assert_bitwise_equal(nan1, nan1.clone())  # NaN equals itself bitwise
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(a, a.double())
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(a, a[:1])
    b = torch.zeros(2, 3, dtype=torch.bfloat16)
    c = b.clone()
    c[1, 2] = 1
    with pytest.raises(AssertionError, match=r"first at \(1, 2\)"):
        assert_bitwise_equal(b, c)


def test_requires_cuda_marks_gpu_and_skips_without_cuda():
    """`pytest -m gpu` (bench/gpu_run.sh on a GPU machine) selects exactly the tests that skip here for lack of CUDA."""
    from epkit.testing.markers import requires_cuda

    def probe():
        pass

    marks = {m.name: m for m in getattr(requires_cuda(probe), "pytestmark", [])}
    assert set(marks) == {"gpu", "skipif"}
    assert marks["skipif"].args == (not torch.cuda.is_available(),)
    assert "needs a CUDA device" in marks["skipif"].kwargs["reason"]
