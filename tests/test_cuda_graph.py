"""CUDA-graph decode: same tokens as eager, no per-step allocation (GPU only)."""

import importlib.util

import pytest
import torch

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.runner import ModelRunner, graph_batch_sizes
from rosecli.engine.scheduler import Scheduler



def test_bucket_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]


def _scheduler(kind: str, graphs: bool, max_batch: int = 24, overlap=None):
    from engine_utils import our_model, tiny_hf_model

    hf = tiny_hf_model(kind, seed=21, vocab=512)
    model = our_model(hf).to("cuda", torch.float16)
    config = EngineConfig(device="cuda", max_batch_size=max_batch, cuda_graph=graphs, paged_attn=True,
                          num_gpu_blocks=512, block_size=16, overlap_schedule=overlap).resolved("cuda")
    runner = ModelRunner(config, model, 256, torch.device("cuda"), torch.float16)
    runner.prepare()
    return Scheduler(config, runner, [1], 256)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_graph_replay_matches_eager_as_sequences_join_and_leave(kind):
    g = torch.Generator().manual_seed(3)
    # 19 requests: batch sizes cross bucket boundaries (1, 2, 4, 8, 16, 24) as they join and finish
    prompts = [torch.randint(2, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (19,), generator=g)]
    lengths = [int(n) for n in torch.randint(1, 60, (19,), generator=g)]
    outs = {}
    # eager and synchronous, graphs and synchronous, graphs with overlap scheduling
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        sched = _scheduler(kind, graphs, overlap=overlap)
        ids, step = [], 0
        while len(ids) < len(prompts) or sched.has_unfinished():
            if len(ids) < len(prompts) and step % 3 == 0:  # staggered arrivals
                for _ in range(1 + step % 4):
                    if len(ids) < len(prompts):
                        i = len(ids)
                        ids.append(sched.add_request(prompts[i], SamplingParams(max_new_tokens=lengths[i],
                                                                                stop_on_eos=False)))
            sched.step()
            step += 1
        outs[graphs, overlap] = [sched.get(i).output_token_ids for i in ids]
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        sched.runner.close()
    assert outs[True, False] == outs[False, False]
    assert outs[True, True] == outs[False, False]


@pytest.mark.gpu
def test_decode_step_allocates_nothing(monkeypatch):
    sched = _scheduler("gpt2", graphs=True, max_batch=8)
    for i in range(5):
        sched.add_request([5 + i, 6, 7], SamplingParams(max_new_tokens=150, stop_on_eos=False))
    sched.step()  # prefill (eager; may allocate)
    sched.step()
    calls = {"n": 0}
    for name in ("tensor", "as_tensor", "from_numpy", "empty", "zeros"):
        real = getattr(torch, name)

        def counting(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, counting)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(100):
        assert sched.step()
        assert sched.last_step_kind == "decode"
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert calls["n"] == 0, "decode steps built tensors on the host"
    assert after - before == 0, "decode steps allocated device memory"


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_sampler_graphs_sample_what_the_eager_sampler_samples(monkeypatch, overlap):
    """Sampling replayed from captured graphs (a decode step's, and a prefill graph's first tokens) gives the
    same tokens as the sampler run eagerly, for seeded requests of every kind (top-k/top-p, penalties + min_p,
    logit_bias + min_tokens, greedy) joining and leaving, so batch sizes and sampler variants change during the
    run."""
    import rosecli.engine.runner as runner_mod

    g = torch.Generator().manual_seed(5)
    kinds = [dict(temperature=0.8, top_p=0.95, top_k=50),
             dict(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                  frequency_penalty=0.3),
             dict(temperature=0.7, logit_bias={7: 5.0, 9: -100.0}, min_tokens=5, stop_token_ids=[3]),
             dict(temperature=0.0)]
    prompts = [torch.randint(2, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (17,), generator=g)]
    lengths = [int(n) for n in torch.randint(6, 50, (17,), generator=g)]
    outs, captured = {}, {}
    for graphs_for_sampler in (False, True):
        monkeypatch.setattr(runner_mod, "MAX_SAMPLER_GRAPHS", 256 if graphs_for_sampler else 0)
        monkeypatch.setattr(runner_mod, "MAX_PREFILL_SAMPLER_GRAPHS", 64 if graphs_for_sampler else 0)
        sched = _scheduler("llama", True, overlap=overlap)
        ids, step = [], 0
        while len(ids) < len(prompts) or sched.has_unfinished():
            if len(ids) < len(prompts) and step % 2 == 0:
                i = len(ids)
                params = SamplingParams(max_new_tokens=lengths[i], stop_on_eos=False, seed=100 + i, **kinds[i % 4])
                ids.append(sched.add_request(prompts[i], params))
            sched.step()
            step += 1
        outs[graphs_for_sampler] = [sched.get(i).output_token_ids for i in ids]
        r = sched.runner
        captured[graphs_for_sampler] = [[v for v in d.values() if v is not None]
                                        for d in (r._sampler_graphs, r._prefill_sampler_graphs)]
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        sched.runner.close()
    # the graphs were made and replayed: decode's, and the first tokens' after prefill graphs
    assert captured[False] == [[], []] and len(captured[True][0]) > 3 and captured[True][1]
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt2", "smollm2-135m"])
def test_no_kernel_variant_is_compiled_after_start_up(monkeypatch, cache_dir, model):
    """Start-up compiles (or loads from Triton's disk cache) every kernel variant a request meets:
    a first request of each kind (one short prompt, W1's burst of 64, a sampled burst, a longer
    prompt) may not wait on Triton (a compile costs 0.1-1 s, a disk-cache load milliseconds)."""
    from triton import knobs

    from rosecli.engine.llm import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device="cuda", dummy_layers=2,
                                    cache_dir=cache_dir, show_progress=False, num_gpu_blocks=512,
                                    enable_prefix_cache=False))
    met = []

    def hook(*a, **kw):
        fn = kw.get("fn")
        met.append((getattr(getattr(fn, "fn", fn), "__name__", fn), kw.get("repr", "")[:200]))
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    try:
        greedy = SamplingParams(max_new_tokens=4, stop_on_eos=False)
        sampled = SamplingParams(max_new_tokens=4, stop_on_eos=False, temperature=0.8, top_p=0.95, top_k=50)
        engine.generate([[100, 101]], greedy)
        engine.generate([[200 + i, 7] for i in range(64)], greedy)
        engine.generate([[300 + i, 7] for i in range(64)], sampled)
        engine.generate([list(range(1000, 1100))], greedy)
        if importlib.util.find_spec("xgrammar") is not None:  # grammar rows, greedy (a masked argmax) and sampled
            from rosecli.engine.structured import GrammarSpec

            spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
            engine.generate([[400 + i, 7] for i in range(2)], [
                SamplingParams(max_new_tokens=6, structured=spec),
                SamplingParams(max_new_tokens=6, structured=spec, temperature=0.7, seed=1)])
    finally:
        engine.close()
    assert not met, f"kernel variants met after start-up: {met}"


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_start_up_runs_every_prefill_gemm_at_every_row_count(monkeypatch, kind):
    """cuBLAS loads a kernel the first time a row count picks it (measured on the H100: a prefill of a
    new token count took up to 50 ms longer once), so start-up runs each distinct linear layer, with
    and without its bias, at every row count up to GEMM_WARMUP_ROWS and every 64th up to the prefill
    budget, and the logits at every count of sampled rows (CPU here: the plan, not the timing)."""
    import torch.nn.functional as F
    from engine_utils import tiny_hf_model, tiny_scheduler

    from rosecli.engine import runner as R

    sched = tiny_scheduler(tiny_hf_model(kind, seed=3), prefill_max_tokens=400, max_batch_size=6,
                           prefill_max_batch_size=5)
    model = sched.runner.model
    ran, logits_rows = set(), []
    real_linear, real_logits = F.linear, model.compute_logits

    def linear(x, w, b=None):
        ran.add((tuple(w.shape), b is not None, x.shape[0]))
        return real_linear(x, w, b)

    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(model, "compute_logits", lambda h: logits_rows.append(h.shape[0]) or real_logits(h))
    sched.runner._warmup_gemms()
    layers = {(tuple(m.weight.shape), m.bias is not None) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(layers) >= 4
    rows = [*range(1, R.GEMM_WARMUP_ROWS + 1), 320, 384]
    for shape, has_bias in layers:
        for m in rows:
            assert (shape, False, m) in ran, (shape, m)
            assert has_bias == ((shape, True, m) in ran), (shape, m)
    assert max(r[2] for r in ran) == 384  # (the budget, 400, is not a row count past 256 that the plan takes)
    assert logits_rows == [1, 2, 3, 4, 5]
