"""StaticBuffer and PinnedStaging: in-place writes keep data_ptr, tails are reset, over-capacity
writes change nothing; a bucket's view (``rows``) starts at the buffer's address and its write resets
the view's tail only (what the bucket's graph reads)."""

import pytest
import torch

from moelora_core import InvalidFieldError, PinnedStaging, StaticBuffer


def test_write_keeps_address_and_resets_tail():
    buf = StaticBuffer("token_lora_mapping", 8, dtype=torch.int32, device="cpu", fill=-1)
    ptr = buf.data_ptr()
    buf.write([3, 1, 2, 0, 0, 1])  # a large batch
    assert buf.tensor.tolist() == [3, 1, 2, 0, 0, 1, -1, -1]
    buf.write([2])  # a small batch after it: nothing stale may remain
    assert buf.tensor.tolist() == [2, -1, -1, -1, -1, -1, -1, -1]
    assert buf.tensor.data_ptr() == ptr


def test_a_bucket_writes_its_view_and_resets_its_tail():
    buf = StaticBuffer("req_weight_indices", 8, dtype=torch.int32, device="cpu", fill=-1)
    buf.write([3, 1, 2, 0, 0, 1])  # a larger bucket's batch
    view = buf.write([2], rows=4)  # a bucket of 4 requests: views of the same memory
    assert view.data_ptr() == buf.data_ptr() and view.tolist() == [2, -1, -1, -1]
    assert buf.tensor.tolist()[4:] == [0, 1, -1, -1], "past the view: what the larger batch left, unread"
    assert buf.view(4).data_ptr() == buf.data_ptr() and buf.view().numel() == 8
    with pytest.raises(InvalidFieldError, match="exceed capacity 2"):
        buf.write([1, 2, 3], rows=2)
    with pytest.raises(InvalidFieldError, match="rows"):
        buf.view(9)
    assert buf.tensor.tolist()[:4] == [2, -1, -1, -1], "a refused write changes nothing"


def test_tail_fill_override_for_segment_pointers():
    seg = StaticBuffer("seg_indptr", 6, dtype=torch.int32, device="cpu", fill=0)
    seg.write([0, 4, 7], tail_fill=7)  # empty trailing segments at the last live offset
    assert seg.tensor.tolist() == [0, 4, 7, 7, 7, 7]


def test_device_tensor_write_and_staged_write():
    buf = StaticBuffer("w", 5, dtype=torch.int32, device="cpu", fill=-1)
    ptr = buf.data_ptr()
    buf.write(torch.tensor([9, 8], dtype=torch.int32))
    assert buf.tensor.tolist() == [9, 8, -1, -1, -1]
    staging = PinnedStaging(16, torch.int32, "cpu")
    with staging.batch() as stage:
        buf.write([4, 4, 4], stage=stage)
    assert buf.tensor.tolist() == [4, 4, 4, -1, -1]
    assert buf.data_ptr() == ptr == buf.tensor.data_ptr()


def test_over_capacity_changes_nothing():
    buf = StaticBuffer("w", 3, dtype=torch.int32, device="cpu", fill=-1)
    buf.write([1, 2])
    with pytest.raises(InvalidFieldError, match="exceed capacity 3"):
        buf.write([1, 2, 3, 4])
    with pytest.raises(InvalidFieldError, match="exceed capacity 3"):
        buf.write(torch.arange(4, dtype=torch.int32))
    assert buf.tensor.tolist() == [1, 2, -1]


def test_staging_alternates_buffers_and_checks_capacity():
    staging = PinnedStaging(4, torch.int32, "cpu")
    a = torch.zeros(3, dtype=torch.int32)
    b = torch.zeros(2, dtype=torch.int32)
    with staging.batch() as stage:
        stage.copy([1, 2, 3], a)
        with pytest.raises(InvalidFieldError, match="staging capacity is 4"):
            stage.copy([7, 7], b)
    first = staging._current
    with staging.batch() as stage:
        stage.copy([5, 6], b)
    assert staging._current != first  # double-buffered: the next batch writes the other buffer
    assert a.tolist() == [1, 2, 3] and b.tolist() == [5, 6]
    with staging.batch() as stage, pytest.raises(InvalidFieldError, match="2 values for a destination of 3"):
        stage.copy([1, 2], a)
    with staging.batch() as stage, pytest.raises(InvalidFieldError, match="dtype"):
        stage.copy([1.0, 2.0], torch.zeros(2))


@pytest.mark.parametrize("built_inside", [True, False], ids=["built-in-inference-mode", "built-outside"])
def test_buffers_built_in_either_mode_take_staged_writes_in_the_other(built_inside):
    # Regression: built inside torch.inference_mode(), both were inference
    # tensors, and every later staged write outside it failed ("Inplace update to inference tensor").
    with torch.inference_mode(built_inside):
        buf = StaticBuffer("w", 4, dtype=torch.int32, device="cpu", fill=-1)
        staging = PinnedStaging(4, torch.int32, "cpu")
    with torch.inference_mode(not built_inside):
        with staging.batch() as stage:
            buf.write([5, 6], stage=stage)
    assert not buf.tensor.is_inference()
    assert buf.tensor.tolist() == [5, 6, -1, -1]


@pytest.mark.parametrize("values", [[2**31], [-(2**31) - 1], [1, 2**40]])
def test_host_values_outside_the_dtype_are_refused_and_change_nothing(values):
    # Regression: write([2**31]) into an int32 buffer raised a raw RuntimeError from the copy.
    buf = StaticBuffer("seg_indptr", 4, dtype=torch.int32, device="cpu", fill=-1)
    buf.write([1, 2])
    with pytest.raises(InvalidFieldError, match=r"seg_indptr: .*outside int32"):
        buf.write(values)
    staging = PinnedStaging(8, torch.int32, "cpu")
    with staging.batch() as stage, pytest.raises(InvalidFieldError, match="outside int32"):
        buf.write(values, stage=stage)
    assert buf.tensor.tolist() == [1, 2, -1, -1]


def test_float_tensor_into_an_integer_buffer_is_refused():
    # A float tensor would be truncated silently ([1.7, 2.9] -> [1, 2]).
    buf = StaticBuffer("weight_indices", 3, dtype=torch.int32, device="cpu", fill=-1)
    with pytest.raises(InvalidFieldError, match=r"weight_indices: .*float"):
        buf.write(torch.tensor([1.7, 2.9]))
    assert buf.tensor.tolist() == [-1, -1, -1]


def test_buffer_keeps_no_autograd_history():
    buf = StaticBuffer("scalings", 4, dtype=torch.float32, device="cpu", fill=0.0)
    buf.write(torch.ones(2, requires_grad=True))
    assert not buf.tensor.requires_grad and buf.tensor.grad_fn is None
    assert buf.tensor.tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("capacity", [2.5, "4", True, -1])
def test_capacity_must_be_a_non_negative_int(capacity):
    with pytest.raises(InvalidFieldError, match="capacity"):
        StaticBuffer("b", capacity, dtype=torch.int32, device="cpu", fill=-1)

