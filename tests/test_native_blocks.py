"""rose's own CPU kernels (rosecli/engine/native): the 4-bit / 8-bit block matmuls against the plain
torch matmul of the same weights, the one-call decode step against the layer-by-layer torch path,
and ``auto`` without them (torch's kernels, a one-line note)."""

import copy
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from engine_utils import VOCAB, our_model, rel_err, tiny_hf_model
from rosecli.engine import native
from rosecli.engine.attention import AttentionMetadata, with_decode_gather
from rosecli.engine.kv_cache import allocate_kv_cache
from rosecli.engine.models.llama import LlamaForCausalLM
from rosecli.engine.models.quant import Float16Linear, Q4Linear, Q8Linear, prepare_cpu_weights, q4_blocks, q8_blocks


@pytest.fixture(scope="module", autouse=True)
def kernels(cache_dir):
    t0 = time.perf_counter()
    lib = native.load(cache_dir)
    if lib is None:
        pytest.skip(f"rose's CPU kernels are unavailable here: {native.unavailable}")
    print(f"native kernels ready in {time.perf_counter() - t0:.2f} s (build: {native.build_seconds})")
    return lib



def _q4_1(out_f, in_f, seed):
    """A weight as a Q4_1 GGUF dequantizes: float16 d and m per block of 32, codes 0..15."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(out_f, in_f // 32, 32, generator=g) * 0.05
    lo, hi = x.amin(-1, keepdim=True).half().float(), x.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    q = torch.clamp(torch.round((x - lo) / d), 0, 15)
    return (q * d + lo).reshape(out_f, in_f)


def _q8_0(out_f, in_f, seed):
    """A weight as a Q8_0 GGUF dequantizes: float16 d = amax / 127 per block, codes -127..127."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(out_f, in_f // 32, 32, generator=g) * 0.05
    d = (x.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(x / d) * d).reshape(out_f, in_f)


@pytest.mark.parametrize("rows", [1, 3, 9])  # the kernel (<= 4 rows), and torch on the dequantized weights
def test_q4_and_q8_linear_equal_the_float_matmul_of_their_weights(rows):
    g = torch.Generator().manual_seed(1)
    for cls, w in ((Q4Linear, _q4_1(96, 192, 2)), (Q8Linear, _q8_0(96, 192, 3))):
        bias = torch.randn(96, generator=g)
        lin = cls(w, bias)
        x = torch.randn(rows, 192, generator=g) * torch.linspace(0.01, 30, 192)  # wide range within blocks
        ref = x.double() @ w.double().T + bias.double()
        # 16-bit activations per block of 32: far inside bfloat16's 2^-9 (what torch's int4 kernel takes)
        assert rel_err(lin(x), ref) < 1e-4
        assert lin(x).dtype == torch.float32 and lin(x).shape == (rows, 96)
    assert q4_blocks(_q4_1(8, 64, 4))[3] and q8_blocks(_q8_0(8, 64, 5))[2]  # GGUF blocks come back exactly
    assert not q4_blocks(torch.randn(8, 64))[3] and not q8_blocks(torch.randn(8, 64))[2]


def test_blocks_read_the_gguf_weights_back_bit_for_bit():
    for cls, kind, w in ((Q4Linear, 4, _q4_1(40, 128, 6)), (Q8Linear, 8, _q8_0(40, 128, 7))):
        lin = cls(w)
        assert torch.equal(native.dequant(kind, lin.codes, lin.scales, 40, 128), w)


def _on_new_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def test_kernels_give_the_same_answer_from_any_thread_and_from_threads_at_once():
    lin = Q4Linear(_q4_1(640, 256, 13))
    xs = [torch.randn(1, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = [lin(x) for x in xs]
    assert all(torch.equal(_on_new_thread(lambda: lin(x)), y) for x, y in zip(xs, want))
    got = [None] * len(xs)

    def run(i):
        for _ in range(50):
            got[i] = lin(xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_decode_matmul_is_as_fast_on_a_worker_thread_as_on_the_main_thread():
    """The streaming manager (`rose chat`, `serve-local`, the benchmark) steps the engine on its own
    long-lived thread. With OpenMP (torch's libgomp) a parallel region started there found more OpenMP
    threads in the process than CPUs and put its threads to sleep after every region: a decode step
    (~150 regions) ran at 0.4x of the main thread's speed on 2 cores. One worker thread lives through
    the test, as the manager's does (a thread started per batch pays for its placement on a CPU, not
    the kernels); best of 7 batches each, interleaved, so that load from other programs hits both
    sides alike."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lin = Q4Linear(_q4_1(1536, 576, 14))  # SmolLM2's gate/up shape
    x = torch.randn(1, 576)

    def batch():
        t0 = time.perf_counter()
        for _ in range(300):
            lin(x)
        return time.perf_counter() - t0

    todo, done = threading.Semaphore(0), threading.Semaphore(0)
    worker, main, stop = [], [], []

    def serve():
        while todo.acquire() and not stop:
            worker.append(batch())
            done.release()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for _ in range(8):  # the first of each side warms up
            main.append(batch())
            todo.release()
            assert done.acquire(timeout=30), "the worker thread stopped"
    finally:
        stop.append(True)
        todo.release()
        t.join(timeout=30)
        torch.set_num_threads(before)
    main, worker = main[1:], worker[1:]
    print(f"300 matmuls: main thread {min(main) * 1e3:.1f} ms, worker thread {min(worker) * 1e3:.1f} ms")
    assert min(worker) <= min(main) / 0.7


def test_auto_and_blocks_choose_layers_by_what_the_weights_are():
    model = our_model(tiny_hf_model("llama", seed=8))
    with torch.no_grad():
        model.layers[0].qkv_proj.weight.copy_(_q4_1(*model.layers[0].qkv_proj.weight.shape, 9))
        model.embed_tokens.weight.copy_(_q8_0(*model.embed_tokens.weight.shape, 10))
    auto = prepare_cpu_weights(copy.deepcopy(model), "auto", blocks=True)
    assert isinstance(auto.layers[0].qkv_proj, Q4Linear) and isinstance(auto.lm_head, Q8Linear)
    assert isinstance(auto.layers[0].o_proj, Float16Linear)  # random float weights: not 4-bit, kept
    blocks = prepare_cpu_weights(copy.deepcopy(model), "blocks", blocks=True)
    assert all(isinstance(m, Q4Linear) for layer in blocks.layers
               for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_one_call_decode_step_matches_the_layer_by_layer_path(kind, monkeypatch):
    """Ragged contexts over out-of-order blocks, GQA, a new token's K/V stored: the native step's
    hidden states and KV cache equal the torch attention path over the same Q4 layers."""
    model = prepare_cpu_weights(our_model(tiny_hf_model(kind, seed=11)), "blocks", blocks=True)
    g = torch.Generator().manual_seed(12)
    block_size, num_blocks = 4, 32
    pool = allocate_kv_cache(model, num_blocks, block_size, torch.float32, torch.device("cpu"))
    pool.copy_(torch.randn(pool.shape, generator=g))
    lens = [1, 7, 13]
    tables = torch.randperm(num_blocks, generator=g)[:12].view(3, 4).to(torch.int32)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, p in enumerate(positions.tolist())])
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=tables,
                             context_lens=torch.tensor(lens, dtype=torch.int32), max_context_len=max(lens))
    ids = torch.randint(0, VOCAB, (3,), generator=g)
    start = pool.clone()
    assert model.native_decode() is not None
    with torch.no_grad():
        fast = model(ids, positions, meta)
        fast_pool = pool.clone()
        pool.copy_(start)
        monkeypatch.setattr(LlamaForCausalLM, "native_decode", lambda self: None)
        slow = model(ids, positions, with_decode_gather(meta, block_size, model.num_kv_heads, torch.float32))
    # the same weights and arithmetic but for float32 rounding order (which can move a 16-bit
    # activation code by one): 1e-4 where a wrong store, rotation or attention row is >1e-2
    assert rel_err(fast, slow) < 1e-4
    assert rel_err(fast_pool, pool) < 1e-5


def test_auto_without_the_kernels_keeps_torch_kernels_with_a_note(tiny_engine_factory, monkeypatch, capsys):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "unavailable", "no C++ compiler (g++) found")
    engine = tiny_engine_factory("tiny-llama", cpu_weights="auto", seed=3)
    assert "note: rose's CPU block kernels are unavailable (no C++ compiler (g++) found)" in capsys.readouterr().err
    assert not any(isinstance(m, (Q4Linear, Q8Linear)) for m in engine.loaded.model.modules())
    out = engine.generate([[5, 6, 7]], __import__("rosecli.engine.config", fromlist=["x"]).SamplingParams(
        max_new_tokens=4, stop_on_eos=False))
    assert len(out[0].token_ids) == 4
