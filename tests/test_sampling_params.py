"""OpenAI's and vLLM's sampling parameters above the sampler (issue 18): `SamplingParams` checks each
range naming the field, the input processor checks logit_bias against the vocabulary, the CLI
takes the options, and ``min_tokens`` keeps EOS, stop token ids and stop strings from ending a
request early (the scheduler and the output processor, as vLLM's stop checker and detokenizer)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_utils import VOCAB, hf_greedy, tiny_hf_model, tiny_scheduler
from rosecli.commands import options as o
from rosecli.engine.config import SamplingParams
from rosecli.engine.errors import ConfigError, RequestError
from rosecli.engine.inputs import InputProcessor
from rosecli.engine.streaming import StreamingManager

# --- SamplingParams ----------------------------------------------------------------------------

BAD = [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("presence_penalty", "1"), ("presence_penalty", True),
    ("frequency_penalty", 3), ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", 1e-9),
    ("repetition_penalty", 101), ("repetition_penalty", math.inf),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", None),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", 129), ("min_tokens", True),
    ("logit_bias", {5: 101}), ("logit_bias", {5: -100.5}), ("logit_bias", {-1: 1}), ("logit_bias", {"5": 1}),
    ("logit_bias", {5: math.nan}), ("logit_bias", {i: 1 for i in range(301)}), ("logit_bias", [5, 1]),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}"[:40] for n, v in BAD])
def test_out_of_range_is_refused_naming_the_field(name, value):
    with pytest.raises(ConfigError) as e:
        SamplingParams(max_new_tokens=128, **{name: value})
    assert str(e.value).startswith(name), str(e.value)


def test_the_edges_are_accepted_and_the_defaults_are_off():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens, p.logit_bias) \
        == (0.0, 0.0, 1.0, 0.0, 0, {})
    p = SamplingParams(max_new_tokens=4, presence_penalty=-2, frequency_penalty=2, repetition_penalty=100,
                       min_p=1, min_tokens=4, logit_bias={i: (-100 if i % 2 else 100) for i in range(300)})
    assert p.min_tokens == 4 and len(p.logit_bias) == 300 and p.logit_bias[1] == -100.0
    assert isinstance(p.logit_bias[0], float)
    assert SamplingParams(repetition_penalty=1e-6, min_p=0).repetition_penalty == 1e-6


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    inputs = InputProcessor(None, 64, VOCAB, None)
    inputs.check_params(SamplingParams(logit_bias={0: 1, VOCAB - 1: -1}))
    with pytest.raises(RequestError) as e:
        inputs.check_params(SamplingParams(logit_bias={3: 1, VOCAB: 5}))
    assert e.value.param == "logit_bias" and f"token id {VOCAB}" in str(e.value)
    with pytest.raises(RequestError) as e:  # process() checks them too, before the prompt
        inputs.process([1, 2], SamplingParams(logit_bias={VOCAB + 7: 5}))
    assert e.value.param == "logit_bias" and f"token id {VOCAB + 7}" in str(e.value)


# --- the CLI -----------------------------------------------------------------------------------

def test_cli_options_build_the_params_and_errors_name_the_flag():
    values = {"max_new_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3,
              "min_p": 0.05, "min_tokens": 3}
    p = o.build_sampling_params(values)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == \
        (0.5, -0.25, 1.3, 0.05, 3)
    for name, value, flag in (("min_p", 2.0, "--min-p"), ("repetition_penalty", 0.0, "--repetition-penalty"),
                              ("presence_penalty", 9.0, "--presence-penalty"),
                              ("frequency_penalty", -9.0, "--frequency-penalty")):
        with pytest.raises(ConfigError, match=f"^{flag} must"):
            o.build_sampling_params({**values, name: value})
    with pytest.raises(ConfigError, match="^--min-tokens must be at most --max-new-tokens"):
        o.build_sampling_params({**values, "min_tokens": 9})


# --- min_tokens: EOS and stop ids (scheduler) --------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=11)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_min_tokens_holds_back_eos_and_stop_ids(hf, overlap):
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, VOCAB, (6,), generator=g).tolist()
    ref = hf_greedy(hf, prompt, 12)
    eos = ref[1]
    assert ref.index(eos) <= 1
    sched = tiny_scheduler(hf, overlap_schedule=overlap, block_size=4, eos=(eos,))
    # without min_tokens EOS ends it at once; with it, not before the 5th token
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12))[0]
    assert seq.num_output_tokens == ref.index(eos) + 1 < 5
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12, min_tokens=5))[0]
    assert seq.num_output_tokens >= 5
    assert seq.finish_reason.value == "length" or seq.output_token_ids[-1] == eos
    # the same for a stop token id
    stop = ref[0]
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12, stop_on_eos=False,
                                                           stop_token_ids=[stop]))[0]
    assert seq.num_output_tokens == 1
    seq = sched.run_to_completion([prompt], SamplingParams(max_new_tokens=12, stop_on_eos=False, min_tokens=4,
                                                           stop_token_ids=[stop]))[0]
    assert seq.num_output_tokens >= 4
    assert seq.finish_reason.value == "length" or seq.output_token_ids[-1] == stop
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# --- min_tokens: stop strings (output processor) -----------------------------------------------

PROMPT = "The capital of France is"
N = 8


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(tiny_engine_factory, request):
    return tiny_engine_factory("tiny-llama", overlap_schedule=request.param, block_size=8)


def _run(engine, params):
    manager = StreamingManager(engine)
    try:
        rid = manager.add_request(PROMPT, params)
        stream = manager.stream(rid)
        streamed = "".join(stream)
        out = stream.output
        assert streamed == out.text
        assert manager.wait_idle() and manager.stats()["kv_blocks_used"] == 0
        return out
    finally:
        manager.close()


def test_a_stop_string_before_min_tokens_does_not_end_the_request(engine):
    ref = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False))
    pieces = [engine.tokenizer.decode([t]) for t in ref.token_ids]
    assert "".join(pieces) == ref.text and all(len(p) >= 3 for p in pieces), pieces
    stop = pieces[0][1:3]  # inside the first token's text, and (the tiny model repeats) in later ones
    assert stop in pieces[2]
    # min_tokens 0: the first token's text holds the stop string
    out = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False, stop=[stop]))
    assert (out.text, out.output_tokens, out.finish_reason) == (pieces[0][:1], 1, "stop")
    # min_tokens 2: the text of the first two tokens is never searched; the third token's is
    out = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False, stop=[stop], min_tokens=2))
    before = len(pieces[0]) + len(pieces[1])
    assert out.finish_reason == "stop" and out.output_tokens == 3
    assert out.text == ref.text[:ref.text.index(stop, before - len(stop) + 1)]
    assert len(out.text) > before - len(stop)
    # min_tokens = max_new_tokens: no stop string can end it
    out = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False, stop=[stop], min_tokens=N))
    assert (out.text, out.output_tokens, out.finish_reason) == (ref.text, N, "length")


def test_a_stop_string_ending_after_min_tokens_may_begin_before(engine):
    """As vLLM: the first token after min_tokens looks for a stop string that ends in its text,
    wherever it begins."""
    ref = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False))
    pieces = [engine.tokenizer.decode([t]) for t in ref.token_ids]
    b1 = len(pieces[0])
    stop = ref.text[b1 - 2:b1 + 2]  # the end of token 1 and the start of token 2
    out = _run(engine, SamplingParams(max_new_tokens=N, stop_on_eos=False, stop=[stop], min_tokens=1))
    assert (out.text, out.output_tokens, out.finish_reason) == (ref.text[:b1 - 2], 2, "stop")
