"""The side-stream copy of a grammar's bitmask (rosecli.engine.aside_copy): through the driver and
through torch, the data arrives, and work queued on the step's stream after it sees the new data."""

import pytest
import torch

from rosecli.engine.aside_copy import AsideCopy, driver


def test_without_a_gpu_there_is_no_copy_to_make_but_the_driver_lookup_does_not_fail():
    # the lookup runs at a grammar's first compile on any machine: it must answer, not raise
    assert driver() is None or hasattr(driver(), "cuMemcpyHtoDAsync_v2")


@pytest.mark.gpu
@pytest.mark.parametrize("through_driver", [True, False])
def test_copy_lands_before_the_step_stream_reads(through_driver):
    dev = torch.device("cuda")
    if through_driver and driver() is None:
        pytest.fail("libcuda could not be loaded on a machine with a CUDA GPU")
    stream = torch.cuda.current_stream(dev)
    copy = AsideCopy(dev, stream)
    if not through_driver:
        copy.lib = None
    g = torch.Generator().manual_seed(0)
    d = torch.zeros(64, 1571, dtype=torch.int32, device=dev)
    for step in range(4):  # each copy overwrites the last; the reads queued after it see the new rows
        host = torch.randint(-2**31, 2**31 - 1, (64, 1571), dtype=torch.int32, generator=g).pin_memory()
        with torch.cuda.stream(copy.side):  # the copy held back: a read not made to wait would see old rows
            torch.cuda._sleep(5_000_000)
        copy(d, host)
        seen = d.clone()  # queued on the step's stream after the copy
        torch.cuda.synchronize()
        assert torch.equal(seen.cpu(), host), f"step {step}"
    assert (copy.lib is not None) == through_driver  # the driver path did not fall back
