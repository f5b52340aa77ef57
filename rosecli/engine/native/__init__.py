"""rose's own CPU kernels (``blocks.cpp``): matmuls that read a GGUF's 4-bit and 8-bit blocks.

torch on CPU has no matmul of 4-bit weights with float32 activations (its int4 kernel takes
bfloat16, which costs agreement: docs/cpu.md). ``blocks.cpp`` rounds activations to 16-bit
integers per block of 32 and multiplies them with the codes exactly (AVX-512 VNNI).

The source is compiled once with the system C++ compiler (plain ``g++ -shared``: no torch headers,
about 2 s) into ``<cache>/native/<key>/`` and loaded with ctypes. Optional: with no compiler, a
CPU without AVX-512 VNNI, or a failed build, `load` returns None and says why in `unavailable`, and
``--cpu-weights auto`` keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("blocks.cpp")
VERSION = 4  # rose_blocks_version() of this source
CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp", "-ffp-contract=off", "-mavx512f",
             "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"]
# what /proc/cpuinfo must list for the compiled code to run
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c")

_lib: Optional[ctypes.CDLL] = None
unavailable: Optional[str] = None  # why the kernels cannot be used, once `load` has failed
build_seconds: Optional[float] = None  # how long the last build took (None: loaded from the cache)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    ident = SOURCE.read_bytes() + " ".join(CXX_FLAGS).encode() + version.encode()
    return hashlib.sha256(ident).hexdigest()[:16]


def _build(cxx: str, target: Path) -> None:
    global build_seconds
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="blocks.", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *CXX_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(tmp, target)  # atomic: another process loads the whole library or builds its own
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    build_seconds = time.perf_counter() - t0


def load(cache_dir: Path) -> Optional[ctypes.CDLL]:
    """The compiled kernels (built into ``cache_dir/native/`` on first use), or None (see `unavailable`)."""
    global _lib, unavailable
    if _lib is not None or unavailable is not None:
        return _lib
    try:
        missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
        if missing:
            raise RuntimeError(f"this CPU lacks {', '.join(missing)}")
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++) found")
        target = Path(cache_dir) / "native" / _key(cxx) / "blocks.so"
        if not target.is_file():
            _build(cxx, target)
        lib = ctypes.CDLL(str(target))
        if lib.rose_blocks_version() != VERSION:
            raise RuntimeError(f"{target} is from another version of rose")
    except Exception as e:  # noqa: BLE001 - optional: any failure means the torch kernels
        unavailable = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        return None
    vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.rose_blocks_matmul.argtypes = [i, vp, i, i, vp, vp, vp, vp, i, i]
    lib.rose_blocks_dequant.argtypes = [i, vp, vp, i, i, vp, i]
    lib.rose_llama_decode.argtypes = [vp, i, vp, vp, vp, vp, vp, vp, i]
    _lib = lib
    return lib


def loaded() -> Optional[ctypes.CDLL]:
    """The kernels if `load` has succeeded in this process."""
    return _lib


def matmul(kind: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
           bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``x [n, K] float32 (contiguous) @ blocks^T (+ bias)`` -> [n, out_features] float32."""
    n, k = x.shape
    y = torch.empty(n, out_features, dtype=torch.float32)
    rc = _lib.rose_blocks_matmul(kind, x.data_ptr(), n, k, codes.data_ptr(), scales.data_ptr(),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                                 torch.get_num_threads())
    if rc:
        raise RuntimeError(f"rose_blocks_matmul failed ({rc}) for x {tuple(x.shape)}")
    return y


def dequant(kind: int, codes: torch.Tensor, scales: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    w = torch.empty(out_features, in_features, dtype=torch.float32)
    rc = _lib.rose_blocks_dequant(kind, codes.data_ptr(), scales.data_ptr(), out_features, in_features,
                                  w.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"rose_blocks_dequant failed ({rc})")
    return w


class _Linear(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                  "block_size", "table_stride", "num_layers")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.c_void_p)]


class LlamaDecode:
    """A whole decode step of a Llama-family model in one call (``rose_llama_decode``): every layer's
    norms, 4-bit matmuls, rotary, KV store and attention over the paged cache, the final norm. For
    models whose linear layers are all `Q4Linear` with float32 norms and KV cache, no per-head q/k norm
    and no sliding window (`build` returns None otherwise: the model's torch code runs)."""

    def __init__(self, model, struct: _Model, layers, keep: list):
        self.model, self._struct, self._layers, self._keep = model, struct, layers, keep
        self._k0 = model.layers[0].attn.k_cache

    @classmethod
    def build(cls, model) -> Optional["LlamaDecode"]:
        from rosecli.engine.models.quant import Q4Linear

        if _lib is None or not hasattr(model, "layers") or not hasattr(model, "rotary"):
            return None
        keep: list = []
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            if (getattr(layer, "q_norm", None) is not None or attn.sliding_window is not None
                    or not all(type(lin) is Q4Linear for lin in linears) or attn.k_cache is None
                    or attn.k_cache.dtype != torch.float32 or not attn.k_cache.is_contiguous()
                    or layer.input_layernorm.weight.dtype != torch.float32 or attn.head_dim > 1024):
                return None
            for lin, field in zip(linears, ("qkv", "o", "gate_up", "down")):
                bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
                keep.append(bias)
                setattr(layers[i], field, _Linear(lin.codes.data_ptr(), lin.scales.data_ptr(),
                                                  None if bias is None else bias.data_ptr()))
            layers[i].ln1 = layer.input_layernorm.weight.data_ptr()
            layers[i].ln2 = layer.post_attention_layernorm.weight.data_ptr()
            layers[i].k_cache, layers[i].v_cache = attn.k_cache.data_ptr(), attn.v_cache.data_ptr()
        first = model.layers[0]
        if model.norm.weight.dtype != torch.float32 or first.input_layernorm.eps != model.norm.eps:
            return None
        struct = _Model(hidden=model.config.hidden_size, heads=first.heads, kv_heads=first.kv_heads,
                        head_dim=first.head_dim, intermediate=first.intermediate,
                        block_size=first.attn.k_cache.shape[2], table_stride=0, num_layers=len(model.layers),
                        eps=float(model.norm.eps), scale=float(first.attn.scale),
                        final_norm=model.norm.weight.data_ptr(), layers=ctypes.addressof(layers))
        return cls(model, struct, layers, keep)

    def current(self) -> bool:
        """Still bound to the model's KV pool (a new pool means a new `build`)."""
        return self.model.layers[0].attn.k_cache is self._k0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids).float().contiguous()
        cos, sin = self.model.rotary.cos[positions], self.model.rotary.sin[positions]
        slots = meta.slot_mapping.long().contiguous() if meta.slot_mapping.dtype != torch.int64 else \
            meta.slot_mapping.contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        ctx = meta.context_lens.to(torch.int32).contiguous()
        self._struct.table_stride = tables.shape[1]
        rc = _lib.rose_llama_decode(ctypes.byref(self._struct), x.shape[0], x.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                                    torch.get_num_threads())
        if rc:
            raise RuntimeError(f"rose_llama_decode failed ({rc})")
        return x
