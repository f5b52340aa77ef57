"""A host-to-device copy on a side stream, which the step's stream then waits for: the copy engine
moves the data while the step's kernels run, instead of in line after them.

torch's way (make the side stream current, ``copy_``, make the step's stream current again, record
an event, wait on it) cost the H100's hosts 9 us a call alone and up to ~30 us inside the engine.
`AsideCopy` makes the same three stream operations as calls into the CUDA driver (``cuMemcpyHtoDAsync``,
``cuEventRecord``, ``cuStreamWaitEvent``, through ctypes), 4.5 us alone on the same host; they keep the GIL
(`ctypes.PyDLL`: each only queues work and returns, and giving the GIL up three times a step would
let another thread hold the engine's up to a switch interval). Where the driver library cannot be
loaded it falls back to torch's way.

The caller keeps both buffers alive and unchanged until the copy is done (pinned host memory, as
for any non-blocking copy) and makes sure no kernel still reads the device buffer.

`RowsCopy` uses the same driver for a decode step's inputs, on the step's own stream: the per-row
fields in one piece and the block tables' first columns as one 2-D copy (``cuMemcpy2DAsync``), so a
step moves the blocks its contexts span rather than every row's whole table (a 128k-token model has
8,192 columns: 2 MB a step at 64 rows), in two calls instead of torch's copy. `IdsFetch` queues the
copy of a step's sampled ids back to the host and the event the host waits on, in two calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import torch

_lib: Optional[ctypes.PyDLL] = None
_tried = False

MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2  # CUmemorytype


class Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (cuda.h, the ``_v2`` layout that ``cuMemcpy2DAsync_v2`` takes): ``Height`` rows of
    ``WidthInBytes`` bytes, each row ``srcPitch`` / ``dstPitch`` bytes after the one before."""

    _fields_ = [(f"{side}{name}", kind) for side in ("src", "dst") for name, kind in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("MemoryType", ctypes.c_int), ("Host", ctypes.c_void_p),
        ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p), ("Pitch", ctypes.c_size_t))] + [
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


def driver() -> Optional[ctypes.PyDLL]:
    """libcuda (the driver the CUDA runtime already loaded), the functions used here typed, called with the
    GIL held; None if absent."""
    global _lib, _tried
    if not _tried:
        _tried = True
        for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
            if not name:
                continue
            try:
                lib = ctypes.PyDLL(name)
            except OSError:
                continue
            vp, u64, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
            try:
                lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, size, vp]
                lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, size, vp]
                lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(Memcpy2D), vp]
                lib.cuEventRecord.argtypes = [vp, vp]
                lib.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
            except AttributeError:  # not a CUDA driver
                continue
            for f in (lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2, lib.cuMemcpy2DAsync_v2, lib.cuEventRecord,
                      lib.cuStreamWaitEvent):
                f.restype = ctypes.c_int
            _lib = lib
            break
    return _lib


class AsideCopy:
    """Copies into device memory on a side stream; ``stream`` (the step's) waits for each one."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream):
        self.stream = stream
        self.side = torch.cuda.Stream(device)
        self.done = torch.cuda.Event()
        self.done.record(self.side)  # (torch creates the event on its first record)
        self.lib = driver()
        self._handles = (stream.cuda_stream, self.side.cuda_stream, self.done.cuda_event)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` (``src`` pinned on the host, both contiguous, the same bytes), beside
        the step's stream, which waits for it."""
        lib = self.lib
        if lib is not None:
            main, side, ev = self._handles
            err = lib.cuMemcpyHtoDAsync_v2(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), side)
            err = err or lib.cuEventRecord(ev, side) or lib.cuStreamWaitEvent(main, ev, 0)
            if not err:
                return
            self.lib = None  # (then torch's way, for good: it raises if the copy itself is wrong)
        torch.cuda.set_stream(self.side)  # (a stream context costs the host twice as much)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(self.stream)
        self.done.record(self.side)
        self.stream.wait_event(self.done)


class RowsCopy:
    """Host (pinned) to device, on ``stream``: bytes ``[start, tables)`` of a staging buffer as they are,
    then the first ``width`` bytes of each of the first ``rows`` rows from ``tables`` on (rows ``pitch``
    bytes apart), into the same offsets of ``dst``. ``lib``: `driver()`'s (a test may give a stand-in)."""

    def __init__(self, lib, dst: torch.Tensor, start: int, tables: int, pitch: int, stream: int):
        self.lib, self.stream = lib, stream
        self.dst, self.start, self.tables = dst.data_ptr(), start, tables
        self.spec = Memcpy2D(srcMemoryType=MEMORYTYPE_HOST, dstMemoryType=MEMORYTYPE_DEVICE,
                             srcPitch=pitch, dstPitch=pitch, dstDevice=self.dst + tables)
        self.spec_ref = ctypes.byref(self.spec)

    def __call__(self, src: torch.Tensor, rows: int, width: int) -> bool:
        """Queue the copy from ``src`` (a host staging buffer laid out as ``dst``); False if the driver
        refused it (the caller then copies another way)."""
        lib, spec, start, base = self.lib, self.spec, self.start, src.data_ptr()
        err = lib.cuMemcpyHtoDAsync_v2(self.dst + start, base + start, self.tables - start, self.stream)
        if err:
            return False
        spec.srcHost = base + self.tables
        spec.WidthInBytes, spec.Height = width, rows
        return not lib.cuMemcpy2DAsync_v2(self.spec_ref, self.stream)


class IdsFetch:
    """Device to host (pinned), on ``stream``: a step's sampled ids into one of two host buffers, then an event
    recorded after the copy (``events``: torch events, made on the device already). ``lib``: `driver()`'s."""

    def __init__(self, lib, hosts: list, events: list, stream: int):
        self.lib, self.stream = lib, stream
        self.hosts = [h.data_ptr() for h in hosts]
        self.events = [e.cuda_event for e in events]

    def __call__(self, ids: Optional[torch.Tensor], n: int, flip: int) -> bool:
        """Copy the ``n`` ids of ``ids`` (int64, contiguous; None: already copied) into host buffer ``flip`` and
        record event ``flip``; False if the driver refused either (the caller then does both through torch)."""
        lib = self.lib
        if ids is not None and lib.cuMemcpyDtoHAsync_v2(self.hosts[flip], ids.data_ptr(), 8 * n, self.stream):
            return False
        return not lib.cuEventRecord(self.events[flip], self.stream)
