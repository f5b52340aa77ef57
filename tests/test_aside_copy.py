"""The side-stream copy of a grammar's bitmask (rosecli.engine.aside_copy): through the driver and
through torch, the data arrives, and work queued on the step's stream after it sees the new data. The
decode inputs' copy (`RowsCopy`): the per-row fields and the block tables' used columns arrive, nothing
else is written, and the driver's 2-D copy struct is laid out as cuda.h's. The sampled ids' way back
(`IdsFetch`): into the step's buffer, then its event."""

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from rosecli.engine.aside_copy import AsideCopy, IdsFetch, Memcpy2D, RowsCopy, driver
from rosecli.engine.runner import _Staging


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


class _HostDriver:
    """The two driver calls `RowsCopy` makes, done on host memory as the CUDA documentation defines
    them (a "device" pointer is a host address here)."""

    def __init__(self):
        self.calls = []

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        self.calls.append(("1d", nbytes, stream))
        ctypes.memmove(dst, src, nbytes)
        return 0

    def cuMemcpyDtoHAsync_v2(self, dst, src, nbytes, stream):
        self.calls.append(("d2h", nbytes, stream))
        ctypes.memmove(dst, src, nbytes)
        return 0

    def cuEventRecord(self, event, stream):
        self.calls.append(("event", event, stream))
        return 0

    def cuMemcpy2DAsync_v2(self, ref, stream):
        spec = ctypes.cast(ref, ctypes.POINTER(Memcpy2D)).contents
        assert (spec.srcMemoryType, spec.dstMemoryType) == (1, 2)  # host to device
        assert spec.srcXInBytes == spec.srcY == spec.dstXInBytes == spec.dstY == 0
        self.calls.append(("2d", spec.WidthInBytes, spec.Height, stream))
        for r in range(spec.Height):
            ctypes.memmove(spec.dstDevice + r * spec.dstPitch, spec.srcHost + r * spec.srcPitch, spec.WidthInBytes)
        return 0


def test_rows_copy_moves_the_row_fields_and_only_the_block_table_columns_a_step_reads():
    mb, nb = 8, 40  # a long-context model's tables: 40 blocks a row, of which a step's contexts span 3
    g = torch.Generator().manual_seed(0)
    nbytes = _Staging.nbytes(mb, nb)
    dev = _Staging(torch.zeros(nbytes, dtype=torch.uint8), mb, nb)
    start, tables = _Staging.copied_span(mb, nb, 0)
    fake = _HostDriver()
    copy = RowsCopy(fake, dev.buf, start, tables, 4 * nb, stream=7)
    for step, (rows, blocks) in enumerate([(5, 3), (8, 1), (2, 40)]):
        host = _Staging(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g), mb, nb)
        before = dev.buf.clone()
        assert copy(host.buf, rows, 4 * blocks)
        for name in ("host_ids", "src", "positions", "slots", "context_lens"):
            assert torch.equal(getattr(dev, name), getattr(host, name)), (step, name)
        assert torch.equal(dev.block_tables[:rows, :blocks], host.block_tables[:rows, :blocks])
        was = _Staging(before, mb, nb)
        assert torch.equal(dev.block_tables[:rows, blocks:], was.block_tables[:rows, blocks:])  # not copied
        assert torch.equal(dev.block_tables[rows:], was.block_tables[rows:])
        assert torch.equal(dev.tokens[:mb], was.tokens[:mb])  # the sampled ids' half of the pool is the device's
    assert fake.calls[:2] == [("1d", tables - start, 7), ("2d", 12, 5, 7)]


class _Event:
    def __init__(self, handle):
        self.cuda_event = handle


def test_ids_fetch_copies_a_steps_ids_into_its_buffer_then_records_its_event():
    hosts = [torch.zeros(16, dtype=torch.long) for _ in range(2)]
    fake = _HostDriver()
    fetch = IdsFetch(fake, hosts, [_Event(101), _Event(202)], stream=7)
    ids = torch.arange(100, 116, dtype=torch.long)
    assert fetch(ids, 5, 1)
    assert hosts[1][:5].tolist() == [100, 101, 102, 103, 104] and not hosts[1][5:].any() and not hosts[0].any()
    assert fetch(None, 3, 0)  # ids already on the host (the masked argmax's graph): the event alone
    assert fake.calls == [("d2h", 40, 7), ("event", 202, 7), ("event", 101, 7)]


def test_the_2d_copy_struct_is_laid_out_as_cuda_h_says():
    import triton

    header = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None or not os.path.isfile(os.path.join(header, "cuda.h")):
        pytest.skip("needs a C compiler and triton's copy of cuda.h")
    fields = [name for name, _ in Memcpy2D._fields_]
    src = "#include <stdio.h>\n#include <stddef.h>\n#include \"cuda.h\"\nint main(void) {\n"
    src += f'  printf("%zu", sizeof(CUDA_MEMCPY2D_v2));\n'
    src += "".join(f'  printf(" %zu", offsetof(CUDA_MEMCPY2D_v2, {f}));\n' for f in fields) + "  return 0;\n}\n"
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rose-memcpy2d-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "m.c"), "w") as f:
        f.write(src)
    subprocess.run([compiler, "-I", header, "-o", os.path.join(work, "m"), os.path.join(work, "m.c")], check=True)
    got = [int(x) for x in subprocess.run([os.path.join(work, "m")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    shutil.rmtree(work, ignore_errors=True)
    assert got == [ctypes.sizeof(Memcpy2D)] + [getattr(Memcpy2D, f).offset for f in fields]


@pytest.mark.gpu
def test_a_decode_that_copies_the_used_columns_says_what_the_whole_rows_copy_says(tiny_engine_factory, monkeypatch):
    """Through the driver, a step copies only the block-table columns its contexts span and its ids come back
    by the driver's copy; the tokens are those of torch's copies (whole rows; greedy and sampled rows, overlapped
    steps, contexts crossing several blocks). The copies, not the step's first kernel (`stage_inputs`)."""
    from rosecli.engine.config import SamplingParams

    monkeypatch.setenv("ROSE_STAGE_KERNEL", "0")
    if driver() is None:
        pytest.fail("libcuda could not be loaded on a machine with a CUDA GPU")
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(6)]
    # greedy rows (the decode graph's argmax) and seeded sampled ones (the sampler's ids)
    params = [SamplingParams(max_new_tokens=40, stop_on_eos=False, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(len(prompts))]
    outs = []
    for driver_copy in (True, False):
        engine = tiny_engine_factory(device="cuda", seed=3)
        runner = engine.runner
        if not driver_copy:
            runner._rows_copy = runner._ids_fetch = False
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        # (the driver's paths did not fall back)
        assert bool(runner._rows_copy) == driver_copy and bool(runner._ids_fetch) == driver_copy
        longest = max(len(p) for p in prompts) + params[0].max_new_tokens
        assert -(-longest // runner.block_size) < runner.max_blocks_per_seq  # some columns were not copied
    assert outs[0] == outs[1]
