"""The C versions of the small ops (kernels/cpu_native.py) against their torch references."""

from __future__ import annotations

import pytest
import torch

from hetero.kernels import implementations, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler builds the kernels")


def pair(op: str):
    impls = {i.name: i.fn for i in implementations(op)}
    return impls["torch"], impls["native"]


@pytest.mark.parametrize("shape", [(1, 576), (17, 64), (3, 5, 96), (0, 32)])
def test_rms_norm(shape):
    ref, fast = pair("rms_norm")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(fast(x, w, 1e-5), ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    strided = torch.randn(shape[0], 2 * shape[-1], generator=g)[:, ::2] if len(shape) == 2 else x
    torch.testing.assert_close(fast(strided, w, 1e-6), ref(strided, w, 1e-6), rtol=1e-5, atol=1e-6)
    xb = x.to(torch.bfloat16)  # other dtypes take the torch path
    torch.testing.assert_close(fast(xb, w, 1e-5), ref(xb, w, 1e-5))


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (2, 3, 64)])
def test_add_rms_norm(shape):
    ref, fast = pair("add_rms_norm")
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    (n1, t1), (n2, t2) = fast(x, r, w, 1e-6), ref(x, r, w, 1e-6)
    assert torch.equal(t1, t2)  # the sum is one float32 add either way
    torch.testing.assert_close(n1, n2, rtol=1e-5, atol=1e-6)


def test_silu_mul_on_split_views_and_contiguous():
    ref, fast = pair("silu_mul")
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(5, 2 * 1536, generator=g) * 4  # gate | up as the fused linear gives them
    gate, up = fused.split(1536, dim=-1)
    torch.testing.assert_close(fast(gate, up), ref(gate, up), rtol=1e-5, atol=1e-6)
    a, b = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    torch.testing.assert_close(fast(a, b), ref(a, b), rtol=1e-5, atol=1e-6)
    big = torch.tensor([[-100.0, 100.0, 0.0, -1e-3]])  # exp overflow and underflow stay finite
    torch.testing.assert_close(fast(big, big), ref(big, big))
