"""The NN worker's finiteness checks of dense parameters and gradients (``train_ctx.all_finite``):
one sum per tensor, confirmed element by element when a sum is not finite."""

import pytest
import torch

from persia.nn_worker.train_ctx import all_finite, finite_step


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_single_non_finite_element_anywhere_is_found(bad):
    tensors = [torch.zeros(3, 4), torch.ones(1000), torch.zeros(2, 2, dtype=torch.float64)]
    assert all_finite(tensors)
    tensors[1][517] = bad
    assert not all_finite(tensors)


def test_large_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((4,), 3e38)  # the float32 sum overflows to inf; every element is finite
    assert torch.isinf(big.sum())
    assert all_finite([big, torch.zeros(2)])
    half = torch.full((10,), 60000.0, dtype=torch.float16)  # a float16 sum would overflow at 65,504
    assert all_finite([half])
    half[3] = float("nan")
    assert not all_finite([half])


def test_inf_and_minus_inf_in_one_tensor_and_nothing_to_check():
    assert not all_finite([torch.tensor([float("inf"), -float("inf")])])  # the sum is nan: still caught
    assert all_finite([]) and all_finite([torch.arange(5)])  # integers cannot be non-finite
    assert not all_finite([torch.tensor([1 + 1j, complex(float("nan"), 0)])])


@pytest.mark.parametrize("loss_value", [0.7, float("nan"), float("inf")])
@pytest.mark.parametrize("grad_bad", [False, True])
def test_the_loss_and_the_gradients_are_answered_separately_in_one_read(loss_value, grad_bad):
    grads = [torch.ones(5, 3), torch.zeros(7)]
    if grad_bad:
        grads[1][2] = float("nan")
    loss = torch.tensor(loss_value)
    loss_ok, grads_ok = finite_step(loss, grads)
    assert loss_ok == (loss_value == 0.7)
    assert grads_ok == (not grad_bad)


def test_a_loss_of_several_elements_huge_values_and_no_gradients():
    assert finite_step(torch.tensor([1.0, float("-inf")]), []) == (False, True)
    assert finite_step(torch.full((3,), 3e38), [torch.full((4,), 3e38)]) == (True, True)  # sums overflow
    assert finite_step(None, []) == (True, True)
