"""``formats.amax.abs_max``: the one-read ``max |x|`` equals ``x.abs().amax()`` bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from lp_lightning.formats.amax import abs_max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_abs_max_equals_abs_then_amax(dtype, layout):
    x = (torch.randn(3, 40, 24) * torch.exp2(torch.randint(-20, 10, (3, 40, 24)).float())).to(dtype)
    x = {"contiguous": x, "transposed": x.mT.contiguous().mT, "sliced": x[:, ::3, 1:]}[layout]
    got, want = abs_max(x), x.abs().amax().to(torch.float32)
    assert got.dtype == torch.float32 and got.shape == () and torch.equal(got, want)
    per_group = abs_max(x, per_group=True)
    assert per_group.shape == (3,) and torch.equal(per_group, x.abs().amax(dim=(1, 2)).to(torch.float32))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_abs_max_propagates_non_finite_values_like_amax(value):
    x = torch.randn(2, 64, 32)
    x[1, 5, 7] = value
    got = abs_max(x, per_group=True)
    assert got[0] == x[0].abs().amax()
    assert (math.isnan(got[1]) and math.isnan(value)) or got[1] == math.inf
    whole = abs_max(x)
    assert (math.isnan(whole) and math.isnan(value)) or whole == math.inf


def test_abs_max_matches_the_bits_of_abs_then_amax_for_signed_zeros_and_nan():
    for x in (torch.tensor([-0.0, -0.0]), torch.tensor([1.0, -float("nan")])):
        got, want = abs_max(x), x.abs().amax()
        assert got.view(torch.int32) == want.view(torch.int32)
    groups = torch.tensor([[-0.0, -0.0], [2.0, -3.0]])
    assert torch.equal(abs_max(groups, per_group=True).view(torch.int32), groups.abs().amax(dim=1).view(torch.int32))


def test_abs_max_per_group_of_a_2d_view_reduces_each_row():
    x = torch.randn(7, 5).mT  # 5 groups of 7
    assert torch.equal(abs_max(x, per_group=True), x.abs().amax(dim=1))


def test_abs_max_refuses_integers():
    with pytest.raises(TypeError, match="floating point"):
        abs_max(torch.tensor([-128, 5], dtype=torch.int8))


def test_abs_max_of_empty_tensors_is_zero():
    assert torch.equal(abs_max(torch.empty(0, 4)), torch.zeros(()))
    assert torch.equal(abs_max(torch.empty(2, 0, 4), per_group=True), torch.zeros(2))
    assert abs_max(torch.tensor([-0.0])).item() == 0.0
