"""Tensor parallelism (rosecli/engine/distributed.py, rosecli/engine/models/parallel.py) on CPU
with gloo: two processes say what one says, sharded checkpoints give the unsharded logits, and
a rank that dies ends the engine and every process. Spawned ranks are slow to start on a small
CPU, so each test starts as few engines as it can."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.distributed import _Mirror, _PlanEncoder
from rosecli.engine.errors import ConfigError
from rosecli.engine.llm import LLMEngine
from rosecli.engine.sequence import PENDING, Sequence

PROMPTS = ["Hello there", "The capital of France is a city", "one two three four five six seven eight nine", "x"]
# greedy, seeded sampling, sampling with top-p and a penalty, unseeded sampling (the engine's seed)
PARAMS = [SamplingParams(max_new_tokens=40, stop_on_eos=False),
          SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, stop_on_eos=False),
          SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.9, repetition_penalty=1.2, stop_on_eos=False),
          SamplingParams(max_new_tokens=40, temperature=1.0, stop_on_eos=False)]


def _engine(cache_dir, tp, model="tiny-llama", **kw):
    kw.setdefault("cpu_weights", "float")
    return LLMEngine(EngineConfig(model=model, load_format="dummy", device="cpu", cache_dir=cache_dir,
                                  show_progress=False, tensor_parallel_size=tp, **kw))


def _outputs(cache_dir, tp, model, prompts, params, **kw):
    engine = _engine(cache_dir, tp, model, **kw)
    try:
        out = engine.generate(prompts, params)
        return [o.token_ids for o in out], engine.scheduler.num_preemptions
    finally:
        engine.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- the step plan sent to the workers --------------------------------------------------------

def test_plan_messages_carry_changes_only_and_rebuild_the_sequences():
    enc, mirror = _PlanEncoder(), _Mirror()
    seq = Sequence(5, list(range(1000)), SamplingParams(temperature=0.5, seed=3))
    seq.block_table = list(range(63))

    def send():
        data = pickle.dumps(enc.encode([seq]))
        (copy,) = mirror.apply(pickle.loads(data))
        assert (copy.token_ids, copy.block_table, copy.num_computed_tokens, copy.num_prompt_tokens) == \
               (seq.token_ids, seq.block_table, seq.num_computed_tokens, seq.num_prompt_tokens)
        assert copy.params == seq.params
        return len(data)

    first = send()  # the prompt, its table and its parameters
    assert first > 1000
    seq.num_computed_tokens = 1000
    seq.token_ids.append(17)
    assert send() < 120  # a decode step: one token, no table
    seq.num_computed_tokens = 1001
    seq.token_ids.append(PENDING)  # overlap: launched before the token is known
    send()
    seq.token_ids.append(PENDING)
    seq.block_table = seq.block_table + [63]  # the block manager replaces a table, never edits it
    send()
    seq.token_ids[-2:] = [42, PENDING]  # the first pending token is known now: it is sent again
    send()
    seq.token_ids[-1] = 43
    seq.block_table, seq.num_computed_tokens = [], 0  # preempted: recomputed from the start
    send()
    enc.forget(5)  # released: a new message introduces it again
    assert send() > 1000


# --- same outputs as one process ---------------------------------------------------------------

def test_tp2_equals_tp1_on_tiny_llama_with_overlap_preemption_and_sampling(cache_dir):
    # 12 blocks of 8 tokens for four requests growing to ~50 tokens: decode runs out and preempts
    kw = dict(overlap_schedule=True, num_gpu_blocks=12, block_size=8, seed=3)
    one, preempted = _outputs(cache_dir, 1, "tiny-llama", PROMPTS, PARAMS, **kw)
    two, preempted_tp = _outputs(cache_dir, 2, "tiny-llama", PROMPTS, PARAMS, **kw)
    assert preempted > 0 and preempted_tp == preempted
    assert two == one
    assert len({tuple(t) for t in one}) == len(one)


def test_tp2_greedy_equals_tp1_on_tiny_gpt2(cache_dir):
    params = SamplingParams(max_new_tokens=24, stop_on_eos=False)
    assert _outputs(cache_dir, 2, "tiny-gpt2", PROMPTS, params)[0] == \
           _outputs(cache_dir, 1, "tiny-gpt2", PROMPTS, params)[0]


def test_a_size_that_does_not_split_the_heads_is_refused_before_anything_starts(cache_dir):
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        _engine(cache_dir, 3)


# --- sharded loading from a Hugging Face directory ---------------------------------------------

def _hf_dirs(root, cache_dir):
    """Tiny random Hugging Face checkpoints (safetensors, tokenizer files): Llama with GQA, Llama with
    one KV head (fewer than the ranks: replicated) and GPT-2; odd vocabularies (a padded last shard)."""
    transformers = pytest.importorskip("transformers")
    from rosecli.engine.loader import dummy_tokenizer

    tok = dummy_tokenizer(EngineConfig(cache_dir=cache_dir))
    torch.manual_seed(0)
    configs = {
        "llama-gqa": transformers.LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, initializer_range=0.2),
        "llama-mqa": transformers.LlamaConfig(vocab_size=999, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                              max_position_embeddings=128, tie_word_embeddings=True,
                                              initializer_range=0.2),
        "gpt2": transformers.GPT2Config(vocab_size=1001, n_embd=64, n_head=4, n_layer=2, n_positions=128,
                                        initializer_range=0.2),
    }
    dirs = {}
    for name, cfg in configs.items():
        out = root / name
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        dirs[name] = str(out)
    return dirs


def _logits(model_dir, ids):
    """The logits of ``ids`` (one prefill) from the model of ``model_dir`` (this rank's part of it)."""
    from rosecli.engine.attention import AttentionMetadata
    from rosecli.engine.kv_cache import allocate_kv_cache
    from rosecli.engine.loader import load_model

    config = EngineConfig(model=model_dir, device="cpu", cpu_weights="float", show_progress=False)
    model = load_model(config, torch.device("cpu"), torch.float32).model
    n = len(ids)
    allocate_kv_cache(model, 1, 16, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             context_lens=torch.tensor([n], dtype=torch.int32), max_context_len=n,
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_seqlen_q=n)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


# ROSE_VOCAB_PAD of each case: ``padded`` pads each rank's vocabulary shard (501 or 500 rows) to 512
PADS = {"plain": None, "padded": "64"}


def _rank_logits(rank, dirs, ids, init_method, out_path):
    """This rank's logits of every model, once per case of PADS. ROSE_VOCAB_PAD is read when a
    model loads (`loader.vocab_pad_multiple`), so setting it here pads the loads after it, as it
    did in ranks spawned with it set: one spawn of the two ranks serves both cases."""
    from rosecli.engine.distributed import _join_group, _leave_group

    _join_group(rank, 2, torch.device("cpu"), init_method)
    try:
        out = {}
        for case, pad in PADS.items():
            if pad is None:
                os.environ.pop("ROSE_VOCAB_PAD", None)
            else:
                os.environ["ROSE_VOCAB_PAD"] = pad
            out[case] = {name: _logits(d, ids) for name, d in dirs.items()}
        if rank == 0:
            torch.save(out, out_path)
    finally:
        _leave_group()


@pytest.fixture(scope="module")
def unsharded_and_sharded_logits(tmp_path_factory, cache_dir):
    """The tiny checkpoints' logits in this process (unsharded, unpadded) and, from one spawn of two
    ranks, each case's gathered logits."""
    from rosecli.engine.distributed import _free_port

    root = tmp_path_factory.mktemp("sharded")
    dirs = _hf_dirs(root, cache_dir)
    ids = [3, 141, 59, 26, 535, 897, 932, 384, 626, 433, 832, 795]
    fulls = {name: _logits(d, ids) for name, d in dirs.items()}
    out_path = str(root / "sharded.pt")
    torch.multiprocessing.start_processes(_rank_logits, args=(dirs, ids, f"tcp://127.0.0.1:{_free_port()}", out_path),
                                          nprocs=2, join=True, start_method="spawn")
    return fulls, torch.load(out_path)


@pytest.mark.parametrize("case", list(PADS))
def test_sharded_hugging_face_checkpoints_give_the_unsharded_logits(unsharded_and_sharded_logits, case):
    """``padded``: each rank's vocabulary shard (501 or 500 rows) padded to 512 (as on CUDA) for its
    logits GEMM; the gathered logits are still the unsharded, unpadded model's."""
    fulls, sharded = unsharded_and_sharded_logits
    for name, full in fulls.items():
        assert sharded[case][name].shape == full.shape, name
        torch.testing.assert_close(sharded[case][name], full, rtol=1e-4, atol=1e-5, msg=name)


# --- the server, and a rank that dies under it -------------------------------------------------

def test_server_answers_as_tp1_and_reports_a_dead_rank(cache_dir):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from test_server import LiveServer

    prompt = "The capital of France is"
    [expected] = _outputs(cache_dir, 1, "tiny-llama", [prompt], SamplingParams(max_new_tokens=16,
                                                                                stop_on_eos=False))[0]
    srv = LiveServer(cache_dir, tensor_parallel_size=2, cpu_weights="float")
    try:
        worker = srv.engine.workers.procs[0].pid
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        text = r.json()["choices"][0]["text"]
        assert text == srv.engine.tokenizer.decode(expected)
        assert httpx.get(srv.url + "/health").status_code == 200

        os.kill(worker, signal.SIGKILL)  # while idle: nothing but the monitor can notice
        deadline = time.monotonic() + 5
        while httpx.get(srv.url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health did not report the dead rank"
            time.sleep(0.05)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        assert "rank 1" in srv.manager.health()["error"]
        assert not _alive(worker)
    finally:
        srv.stop()


# --- the command: a rank killed mid-run, SIGTERM ----------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids


def _start_generate(cache_dir):
    """`rose generate -tp 2` on a long run; returns it once it printed text, with its spawned rank's pid."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), ROSE_CACHE_DIR=cache_dir)
    p = subprocess.Popen([sys.executable, "-m", "rosecli", "generate", "-tp", "2", "--model", "tiny-llama",
                          "--load-format", "dummy", "--device", "cpu", "-n", "100000", "--no-stop-on-eos", "Hello"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout.read(1)  # decoding has started
    ranks = []
    for k in _children(p.pid):
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                ranks.append(k)
    assert len(ranks) == 1
    return p, ranks[0], _children(p.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_killed_mid_run_ends_the_command_with_a_clear_message_and_no_process_left(cache_dir):
    p, rank, kids = _start_generate(cache_dir)
    os.kill(rank, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert p.returncode not in (0, None)
    last = err.decode().strip().splitlines()[-1]
    assert "tensor-parallel rank 1" in last and "died (killed by SIGKILL)" in last
    time.sleep(0.5)
    assert not any(_alive(k) for k in kids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_on_rank_0_ends_every_rank(cache_dir):
    p, rank, kids = _start_generate(cache_dir)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids):
        assert time.monotonic() < deadline, "a rank outlived rank 0"
        time.sleep(0.05)


# --- GPUs ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_size_beyond_the_visible_gpus_is_refused(cache_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"--tensor-parallel-size {n + 1} needs {n + 1} GPUs"):
        LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", device="cuda", cache_dir=cache_dir,
                               show_progress=False, tensor_parallel_size=n + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_tp2_on_two_gpus_with_cuda_graphs_and_overlap_equals_tp1(cache_dir, model):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert os.environ.get("NCCL_NVLS_ENABLE", "0") == "0"
    kw = dict(device="cuda", dtype="float32", cuda_graph=True, overlap_schedule=True, seed=3)
    outs = []
    for tp in (1, 2):
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", cache_dir=cache_dir, show_progress=False,
                                        tensor_parallel_size=tp, **kw))
        try:
            assert engine.runner.graphs  # decode replays captured graphs (with NCCL all-reduces at TP=2)
            outs.append([o.token_ids for o in engine.generate(PROMPTS, PARAMS)])
        finally:
            engine.close()
    assert outs[1] == outs[0]
