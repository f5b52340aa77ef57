"""Measure the grammar libraries rosecli could use for structured output, on this machine's CPU.

For each library (xgrammar, llguidance; whichever is installed) and each vocabulary (SmolLM2's
49,152 tokens, and a synthetic 152,064-token vocabulary: SmolLM2's tokens plus pairs of them, the
size of Qwen2's), it reports:

- tokenizer set-up: building the library's view of the vocabulary (once per engine);
- compile: a JSON schema (objects, arrays, enums, nested and optional fields) compiled cold, and
  a regex; the time a request with a new schema waits before admission;
- mask fill at B=64: 64 matchers of that schema walked in lock step along a valid document's
  tokens; per decode step, the time to fill all 64 rows of a packed int32 bitmask (the host-side
  cost that grammar requests add to a step), with the library's own batched / parallel fill;
- mask apply at B=64 on CPU: the library's bitmask apply op on [64, V] float32 logits, and rosecli's
  own (`rosecli.engine.structured`: one gather, shift and masked fill, CUDA-graph friendly).

    python scripts/bench_grammar_libs.py [--tokenizer DIR] [--threads N] [--steps N]

Results on the 2-core development machine are in docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "role": "admin",
       "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}, "score": 9.5,
       "active": True}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"


def find_tokenizer(arg):
    for d in (arg, os.path.expanduser("~/.cache/rosecli/models/smollm2-135m"), "/work/main/.gpucache/tokenizers/smollm2"):
        if d and os.path.exists(os.path.join(d, "tokenizer.json")):
            return d
    raise SystemExit("no tokenizer found: pass --tokenizer DIR (a directory holding tokenizer.json)")


def vocabularies(tok_dir):
    """(name, list of token bytes, eos id, hf tokenizer) for the real vocabulary and a 152k one."""
    from transformers import AutoTokenizer

    import xgrammar as xgr

    hf = AutoTokenizer.from_pretrained(tok_dir)
    info = xgr.TokenizerInfo.from_huggingface(hf)
    base = [bytes(b) for b in info.decoded_vocab]
    eos = hf.eos_token_id
    rng = random.Random(0)
    seen = set(base)
    synth = list(base)
    plain = [b for b in base if b and len(b) <= 8]
    while len(synth) < 152064:
        t = rng.choice(plain) + rng.choice(plain)
        if t not in seen:
            seen.add(t)
            synth.append(t)
    return hf, [("smollm2 (49,152)", base, eos), ("synthetic (152,064)", synth, eos)]


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_xgrammar(vocab, eos, doc_ids, B, steps, threads):
    import xgrammar as xgr

    V = len(vocab)
    t_tok, info = timed(lambda: xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[eos]))
    t_compiler, compiler = timed(lambda: xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False))
    t_schema, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    t_regex, _ = timed(lambda: compiler.compile_regex(REGEX))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(B)]
    bitmask = xgr.allocate_token_bitmask(B, V)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    fills = []
    for tok in doc_ids[:steps]:
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        fills.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.accept_token(tok), "the document's tokens must be accepted"
    logits = torch.randn(B, V)
    t_apply, _ = timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), repeat=5)
    return dict(tokenizer_s=t_tok + t_compiler, schema_compile_s=t_schema, regex_compile_s=t_regex, fills=fills,
                apply_s=t_apply)


def bench_llguidance(vocab, eos, doc_ids, B, steps, threads, hf):
    import llguidance as llg
    import llguidance.torch as llgt

    V = len(vocab)

    class Tok:
        eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, vocab, [eos]

        def __call__(self, s):
            return hf.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_special_tokens=False)

    t_tok, lt = timed(lambda: llg.LLTokenizer(llg.TokenizerWrapper(Tok()), n_vocab=V))
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    # llguidance compiles lazily: the first matcher pays for it (its lexer is built on demand)
    t_schema, m0 = timed(lambda: llg.LLMatcher(lt, grammar))
    assert not m0.is_error(), m0.get_error()
    t_regex, _ = timed(lambda: llg.LLMatcher(lt, llg.LLMatcher.grammar_from_regex(REGEX)))
    matchers = [llg.LLMatcher(lt, grammar) for _ in range(B)]
    bitmask = llgt.allocate_token_bitmask(B, V)
    ex = llg.LLExecutor(num_threads=threads)
    fills = []
    for tok in doc_ids[:steps]:
        t0 = time.perf_counter()
        llgt.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fills.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.consume_token(tok), m.get_error()
    logits = torch.randn(B, V)
    llgt.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile's first call
    t_apply, _ = timed(lambda: llgt.apply_token_bitmask_inplace(logits, bitmask), repeat=5)
    return dict(tokenizer_s=t_tok, schema_compile_s=t_schema, regex_compile_s=t_regex, fills=fills, apply_s=t_apply)


def rose_apply_s(B, V):
    """rosecli's device op (the same torch ops as StructuredOutput.mask_logits), on CPU."""
    cols = torch.arange(V)
    word, bit = cols // 32, (cols % 32).to(torch.int32)
    mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), dtype=torch.int32)
    logits = torch.randn(B, V)

    def run():
        logits.masked_fill_(((mask.index_select(1, word) >> bit) & 1) == 0, float("-inf"))
    return timed(run, repeat=5)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (default: SmolLM2's)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="decode steps measured (tokens of the document)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    args = ap.parse_args()
    hf, vocabs = vocabularies(find_tokenizer(args.tokenizer))
    doc_ids = hf.encode(json.dumps(DOC), add_special_tokens=False)  # ", " and ": " as both compile it
    print(f"document: {len(doc_ids)} tokens; B={args.batch}; threads={args.threads}; cpus={os.cpu_count()}")
    print(f"{'library':<12} {'vocabulary':<20} {'tokenizer':>10} {'schema':>9} {'regex':>9} "
          f"{'fill B=64 median':>17} {'p90':>8} {'mean':>8} {'per row':>8} {'apply':>8} {'rose apply':>10}")
    for name, vocab, eos in vocabs:
        for lib in args.libs.split(","):
            try:
                if lib == "xgrammar":
                    r = bench_xgrammar(vocab, eos, doc_ids, args.batch, args.steps, args.threads)
                elif lib == "llguidance":
                    r = bench_llguidance(vocab, eos, doc_ids, args.batch, args.steps, args.threads, hf)
                else:
                    raise SystemExit(f"unknown library {lib!r}")
            except ImportError as e:
                print(f"{lib:<12} not installed ({e})")
                continue
            f = sorted(r["fills"])
            mean = statistics.fmean(f)
            med, p90 = statistics.median(f), f[int(0.9 * (len(f) - 1))]
            print(f"{lib:<12} {name:<20} {r['tokenizer_s'] * 1e3:8.0f}ms {r['schema_compile_s'] * 1e3:7.1f}ms "
                  f"{r['regex_compile_s'] * 1e3:7.1f}ms {med * 1e3:15.2f}ms {p90 * 1e3:6.2f}ms "
                  f"{mean * 1e3:6.2f}ms {med / args.batch * 1e6:6.1f}us {r['apply_s'] * 1e3:6.2f}ms "
                  f"{rose_apply_s(args.batch, len(vocab)) * 1e3:8.2f}ms")


if __name__ == "__main__":
    main()
