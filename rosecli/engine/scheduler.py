"""The online scheduler: continuous batching, chunked prefill, preemption, stopping.

Policy (stated here and kept):
- Admission is first come, first served; a request that does not fit (KV blocks, active-set
  or batch limits) blocks those behind it, so nobody is overtaken.
- A step is either a prefill step or a decode step. Prefill goes first, but never twice in a
  row while decodes are running: a decode step always follows a prefill step, so a running
  stream stalls for at most one prefill chunk (``prefill_max_tokens`` tokens).
- Prompts longer than the step's token budget are prefilled in chunks over several steps.
- The decode batch holds at most ``max_batch_size`` sequences; when more are running they take
  turns in round-robin order.
- When a decode step needs a KV block and none is free, the most recently admitted request is
  preempted: its blocks are freed and it waits at the head of the queue to be recomputed
  (prompt plus the tokens it already produced; nothing a user received is dropped or repeated).
- A request whose prompt (plus the one token it must generate) needs more KV blocks than the
  whole pool has is refused when added. One that grows to as many tokens as the pool holds is
  finished with "length", as at the model's context: it could not grow even alone in the pool,
  and waiting for room would wait forever.

Overlap (``--overlap-schedule``, on by default on CUDA): while decode step N runs on the GPU,
``step()`` schedules and launches step N+1 (each sequence's new token is `PENDING` on the host
and read from step N's output on the device), and only then reads step N's tokens, checks
stops and returns them. So ``step()`` returns the tokens of the decode step launched by the
call before it. A sequence whose length limit ends it at step N is left out of step N+1; one
that stops on EOS at step N has its step-N+1 token dropped; so does one that the output processor
finishes (``finish_request``) on a stop string it found in step N's text, before the next ``step()``.
Prefill steps and preemption never overlap: the step in flight is read first.

Choices (``n`` > 1, `add_group`): the first choice is the leader, queued as any request; the
others wait attached to it (counted at its admission, with a KV block each for a copy of the
prompt's last, partly filled block). The prompt is prefilled once, by the leader; the step that
completes it samples every choice's first token from the same logits, then the others fork:
they share the prompt's full KV blocks (reference counts) and go on as independent sequences.

Logprobs, for the requests that asked, come next to the step's tokens: ``step_logprobs`` {request
id: `TokenLogprobs`} and, with a request's first token, ``step_prompt_logprobs`` {request id:
[None, `TokenLogprobs` of each later prompt token]}, both replaced at every step.

The scheduler holds token and block state only: prompts arrive as checked token ids
(`rosecli.engine.inputs`), and text, stop strings and finish text are the output processor's
(`rosecli.engine.outputs`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional, Union

from rosecli.engine.block_manager import BlockManager, check_group
from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import RequestError
from rosecli.engine.logprobs import TokenLogprobs
from rosecli.engine.runner import DecodeLaunch, ModelRunner
from rosecli.engine.sequence import PENDING, FinishReason, Sequence, SequenceStatus
from rosecli.engine.stages import Stages
from rosecli.engine.step_plan import StepPlan


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner, eos_token_ids: list[int],
                 max_model_len: int, stages: Optional[Stages] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        runner.eos_token_ids = sorted(self.eos_token_ids)  # min_tokens holds them back in sampling
        self.max_model_len = max_model_len
        self.stages = stages or runner.stages
        self.clock = clock
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_cache)
        # a sequence stops at the model's context or at what the whole KV pool holds, whichever is less
        self.max_seq_len = min(max_model_len, runner.num_blocks * config.block_size)
        self.max_active = config.max_active_requests or config.max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not fully computed yet
        self.running: list[Sequence] = []  # decoding
        self.seqs: dict[int, Sequence] = {}
        self._finished_ids: list[int] = []
        self._next_id = 0
        self._arrivals = 0
        self._last_was_prefill = False
        self.last_step_kind = "idle"  # "prefill" | "decode" | "idle": what the last step() ran
        self._rr = 0
        self.overlap = config.overlap_schedule  # resolved for the device (EngineConfig.resolved)
        self._inflight: Optional[DecodeLaunch] = None  # decode step launched, tokens not read yet
        self.num_preemptions = 0
        self.finish_counts: dict[str, int] = {}
        self.num_prefill_tokens = 0  # tokens computed by prefill steps (prompts, and recomputation)
        self._forks: dict[int, list[Sequence]] = {}  # leader's request id -> its other choices, until they fork
        self._prompt_lp: dict[int, dict[int, TokenLogprobs]] = {}  # prompt logprobs by position, until the first token
        self.step_logprobs: dict[int, TokenLogprobs] = {}
        self.step_prompt_logprobs: dict[int, list[Optional[TokenLogprobs]]] = {}

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, token_ids: list[int], params: Optional[SamplingParams] = None,
                    request_id: Optional[int] = None) -> int:
        """Queue a request of checked token ids (`InputProcessor.process`: the scheduler trusts them)."""
        token_ids = list(token_ids)
        params = params or SamplingParams()
        if request_id is None:
            request_id = self._next_id
            self._next_id += 1
        elif request_id in self.seqs:
            raise RequestError(f"request id {request_id} is already in use")
        else:
            self._next_id = max(self._next_id, request_id + 1)
        seq = self._set_limits(Sequence(request_id, token_ids, params, self._arrivals))
        self._arrivals += 1
        self.runner.add_request(seq)  # last: nothing else can fail and leave it half added
        self.seqs[request_id] = seq
        self.waiting.append(seq)
        return request_id

    def check_group(self, n: int, num_prompt_tokens: int) -> None:
        """Whether ``n`` choices of a prompt can ever run together (any thread: reads the config
        only); a RequestError naming ``n`` otherwise."""
        check_group(self.config, self.block_manager, n, num_prompt_tokens)

    def add_group(self, token_ids: list[int], params: list[SamplingParams], request_ids: list[int]) -> list[int]:
        """Queue the choices of one prompt (one `SamplingParams` and request id each): the prompt is
        prefilled once and its KV shared (module doc)."""
        self.check_group(len(params), len(token_ids))
        leader = self.add_request(token_ids, params[0], request_ids[0])
        followers = []
        try:
            for p, rid in zip(params[1:], request_ids[1:]):
                if rid in self.seqs:
                    raise RequestError(f"request id {rid} is already in use")
                seq = self._set_limits(Sequence(rid, list(token_ids), p, self.seqs[leader].arrival_index))
                self.runner.add_request(seq)
                followers.append(seq)
        except BaseException:
            self.finish_request(leader, FinishReason.ERROR)
            raise
        for seq in followers:
            self.seqs[seq.request_id] = seq
        if followers:
            self._forks[leader] = followers
        return [leader] + [s.request_id for s in followers]

    def _set_limits(self, seq: Sequence) -> Sequence:
        """What ends ``seq`` (`Sequence`'s limits from its own parameters) narrowed by this engine's: the model's
        context and, with ``stop_on_eos``, its EOS ids; worked out once for the checks of every step (`_check_stop`)."""
        seq.length_limit = min(seq.length_limit, self.max_seq_len)
        if seq.params.stop_on_eos:
            seq.stop_ids = seq.stop_ids | self.eos_token_ids
        return seq

    def has_unfinished(self) -> bool:
        # a step in flight holding only finished sequences needs no reading: their tokens are dropped
        return bool(self.waiting or self.prefilling or self.running)

    def pop_finished_ids(self) -> list[int]:
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def get(self, request_id: int) -> Optional[Sequence]:
        return self.seqs.get(request_id)

    def pop_request(self, request_id: int) -> Optional[Sequence]:
        """Forget a finished request; returns its sequence (None when unknown)."""
        return self.seqs.pop(request_id, None)

    def finish_request(self, request_id: int, reason: FinishReason) -> Optional[Sequence]:
        """End a request now and forget it (a stop string found in its text, its caller went away,
        handling it failed); its blocks are released at once and a token of it in a step in flight
        is dropped, as when it stops on EOS. It is not announced by ``pop_finished_ids``. A finished
        request is only forgotten. Returns its sequence (None when unknown)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if not seq.is_finished:
            self._finish(seq, reason, announce=False)
        if not self.running:  # a step in flight now holds only finished sequences
            self._inflight = None
        return seq

    def discard_request(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> None:
        """Drop a request whose caller went away (or, with ``reason`` ERROR, whose handling failed)."""
        self.finish_request(request_id, reason)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> dict[int, int]:
        """Run one prefill or decode step; return the token each request produced in it (with
        overlap, a decode step's tokens come back from the next call)."""
        with self.stages.range("scheduler_step"):
            if self.step_logprobs:
                self.step_logprobs = {}
            if self.step_prompt_logprobs:
                self.step_prompt_logprobs = {}
            if self._inflight is not None:
                return self._step_overlapped()
            can_prefill = bool(self.prefilling or self.waiting)
            if can_prefill and not (self._last_was_prefill and self.running):
                with self.stages.range("prefill_admission"):
                    plan = self._schedule_prefill()
                if plan is not None:
                    self._last_was_prefill = True
                    self.last_step_kind = "prefill"
                    return self._run_prefill(plan)
            self._last_was_prefill = False
            plan = self._schedule_decode(allow_preempt=True)
            if plan is None:
                self.last_step_kind = "idle"
                return {}
            self.last_step_kind = "decode"
            launch = self._launch_decode(plan)
            if self.overlap and not self._prefill_due():  # the next step can launch behind this one
                self._inflight = launch
                return {}
            return self._read_decode(launch)

    def _step_overlapped(self) -> dict[int, int]:
        """Launch the next decode step if nothing else is due, then read the one in flight."""
        inflight, self._inflight = self._inflight, None
        if not self._prefill_due():
            plan = self._schedule_decode(allow_preempt=False)
            if plan is not None:
                self._inflight = self._launch_decode(plan)
        self.last_step_kind = "decode"
        out = self._read_decode(inflight)
        if not self.running:  # the step just launched holds only finished sequences: nothing to read
            self._inflight = None
        return out

    def _prefill_due(self) -> bool:
        """Whether the next step would be a prefill (the admission test without admitting)."""
        if self.prefilling:
            return True
        return bool(self.waiting) and self._can_admit(self.waiting[0])

    def _can_admit(self, seq: Sequence) -> bool:
        """FCFS admission of the queue's head: room in the active set and KV blocks for its prompt
        (with its other choices, and a block each for their copy of a partly filled last block)."""
        forks = self._forks.get(seq.request_id, ()) if self._forks else ()
        active = len(self.prefilling) + len(self.running)
        if self._forks:
            active += sum(len(self._forks.get(s.request_id, ())) for s in self.prefilling)
        reserve = len(forks) if len(seq.token_ids) % self.block_manager.block_size else 0
        return active + len(forks) < self.max_active and self.block_manager.can_allocate(seq, reserve)

    def _sample_rows(self, seq: Sequence, n: int) -> int:
        """Rows a prefill chunk of ``n`` tokens of ``seq`` samples: none, one, or one per choice."""
        if n < seq.num_uncomputed_tokens:
            return 0
        return 1 + (len(self._forks.get(seq.request_id, ())) if self._forks else 0)

    def _schedule_prefill(self) -> Optional[StepPlan]:
        cfg = self.config
        budget = cfg.prefill_max_tokens
        batch: list[Sequence] = []
        chunks: list[int] = []
        # the runner samples at most this many rows a step (choices of n > 1 are a row each)
        max_rows, rows = max(cfg.prefill_max_batch_size, cfg.max_batch_size), 0
        for seq in self.prefilling:  # continue chunked prompts first, in admission order
            if budget <= 0 or len(batch) >= cfg.prefill_max_batch_size:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if self._forks and rows + self._sample_rows(seq, n) > max_rows:
                break
            rows += self._sample_rows(seq, n)
            batch.append(seq)
            chunks.append(n)
            budget -= n
        now = None
        while self.waiting and budget > 0 and len(batch) < cfg.prefill_max_batch_size:
            seq = self.waiting[0]
            if not self._can_admit(seq):
                break
            if self._forks and rows + self._sample_rows(seq, min(seq.num_uncomputed_tokens, budget)) > max_rows:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.admitted_at is None:
                now = now or self.clock()
                seq.admitted_at = now
            self.prefilling.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            rows += self._sample_rows(seq, n)
            batch.append(seq)
            chunks.append(n)
            budget -= n
        if not batch:
            return None
        forks = None
        if self._forks:
            forks = {i: self._forks[s.request_id] for i, (s, n) in enumerate(zip(batch, chunks))
                     if s.request_id in self._forks and n == s.num_uncomputed_tokens} or None
        return StepPlan.prefill(batch, chunks, forks)

    def _schedule_decode(self, allow_preempt: bool) -> Optional[StepPlan]:
        """The next decode step, with a slot for each new token; None when nothing can decode or,
        without ``allow_preempt`` (a step is in flight), a sequence would need a block none is free for."""
        running = self.running
        if not running:
            return None
        limit = self.config.max_batch_size
        if len(running) > limit:  # take turns
            start = self._rr % len(running)
            batch = (running[start:] + running[:start])[:limit]
            self._rr = start + limit
        else:
            batch = list(running)
        bm = self.block_manager
        bs = bm.block_size
        running_status = SequenceStatus.RUNNING
        scheduled: list[Sequence] = []
        preempted = False
        for seq in batch:
            n = len(seq.token_ids)
            # a sequence whose pending token is its last (step in flight) needs no further step
            if seq.status is not running_status or n >= seq.length_limit:
                continue
            if len(seq.block_table) * bs < n:  # its newest token starts a block
                if not allow_preempt and not bm.can_append(seq):
                    return None
                while not bm.can_append(seq):
                    victim = self._newest_admitted()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                else:
                    bm.append_slots(seq)
                    scheduled.append(seq)
            else:
                scheduled.append(seq)
        if preempted:  # a victim may be one scheduled before it
            scheduled = [s for s in scheduled if s.status is running_status]
        return StepPlan.decode(scheduled) if scheduled else None

    def _newest_admitted(self) -> Sequence:
        candidates = self.running + self.prefilling
        return max(candidates, key=lambda s: s.arrival_index)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _run_prefill(self, plan: StepPlan) -> dict[int, int]:
        runner = self.runner
        sampled = runner.execute(plan)
        out: dict[int, int] = {}
        bm = self.block_manager
        cache = bm.enable_prefix_cache
        forks = plan.forks or {}
        if runner.prompt_logprobs:
            self._gather_prompt_logprobs(plan.seqs, runner.prompt_logprobs)
        self.num_prefill_tokens += sum(plan.num_new_tokens)
        for i, (seq, n, token) in enumerate(zip(plan.seqs, plan.num_new_tokens, sampled)):
            seq.num_computed_tokens += n
            if cache:
                bm.commit_full_blocks(seq)
            if token is None:
                continue  # a chunk of a longer prompt
            self.prefilling.remove(seq)
            self.running.append(seq)
            if i in forks:
                self._fork(seq, forks[i])
            self._first_token(seq, token, out)
        children = [c for i in sorted(forks) for c in forks[i]]
        for child, token in zip(children, sampled[len(plan.seqs):]):
            self._first_token(child, token, out)
        return out

    def _first_token(self, seq: Sequence, token: int, out: dict[int, int]) -> None:
        lp = self.runner.prefill_logprobs.get(seq.request_id) if self.runner.prefill_logprobs else None
        if lp is not None:
            self.step_logprobs[seq.request_id] = lp
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            got = self._prompt_lp.pop(seq.request_id, {})
            self.step_prompt_logprobs[seq.request_id] = [None] + [got.get(t) for t in range(1, seq.num_prompt_tokens)]
        seq.token_ids.append(token)
        self._accept(seq, token, len(seq.token_ids), out)

    def _gather_prompt_logprobs(self, seqs: list[Sequence], computed: dict) -> None:
        """Keep a chunk's prompt logprobs until the request's first token (not again for a request
        recomputed after preemption: its caller has them)."""
        for seq in seqs:
            got = computed.get(seq.request_id)
            if got is not None and seq.num_output_tokens == 0:
                first, entries = got
                acc = self._prompt_lp.setdefault(seq.request_id, {})
                for j, e in enumerate(entries):
                    acc[first + j] = e

    def _fork(self, leader: Sequence, children: list[Sequence]) -> None:
        """The leader's prompt is computed: its other choices take its KV (module doc)."""
        del self._forks[leader.request_id]
        bm = self.block_manager
        pairs = [pair for c in children if (pair := bm.fork(leader, c)) is not None]
        self.runner.copy_blocks(pairs)
        lp = self._prompt_lp.get(leader.request_id)
        for c in children:
            c.status = SequenceStatus.RUNNING
            c.admitted_at = leader.admitted_at
            self.running.append(c)
            if lp is not None:
                self._prompt_lp[c.request_id] = lp

    def _launch_decode(self, plan: StepPlan) -> DecodeLaunch:
        launch = self.runner.launch_decode(plan)
        for seq in plan.seqs:
            seq.token_ids.append(PENDING)
        return launch

    def _read_decode(self, launch: DecodeLaunch) -> dict[int, int]:
        """Fill in a launched decode step's tokens; a sequence that finished meanwhile (a stop in
        the step before, or discarded) drops its token."""
        sampled = self.runner.collect(launch)
        lps = launch.logprobs
        out: dict[int, int] = {}
        bm = self.block_manager
        cache = bm.enable_prefix_cache
        bs = bm.block_size
        running = SequenceStatus.RUNNING
        for seq, token in zip(launch.seqs, sampled):
            if seq.status is not running:
                continue
            tokens = seq.token_ids
            index = tokens.index(PENDING, seq.num_computed_tokens)  # the oldest pending token is this step's
            tokens[index] = token
            seq.num_computed_tokens += 1
            if cache and seq.num_computed_tokens % bs == 0:  # this step filled a block
                bm.commit_full_blocks(seq)
            rid = seq.request_id
            if lps and rid in lps:
                self.step_logprobs[rid] = lps[rid]
            out[rid] = token
            length = index + 1  # (`_accept`, inline: this loop runs for every row of every step)
            if (token in seq.stop_ids and length >= seq.stop_from) or length >= seq.length_limit:
                self._finish(seq, self._check_stop(seq, token, length))
        return out

    def _accept(self, seq: Sequence, token: int, length: int, out: dict[int, int]) -> None:
        """Record a sampled token (the sequence's first ``length`` tokens are now known) and stop
        the sequence if it ends there."""
        out[seq.request_id] = token
        reason = self._check_stop(seq, token, length)
        if reason is not None:
            self._finish(seq, reason)

    def _check_stop(self, seq: Sequence, token: int, length: int) -> Optional[FinishReason]:
        if token in seq.stop_ids and length >= seq.stop_from:
            return FinishReason.STOP
        if length >= seq.length_limit:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, announce: bool = True) -> None:
        seq.status = SequenceStatus.FINISHED
        while seq.token_ids and seq.token_ids[-1] == PENDING:  # its step in flight is dropped
            seq.token_ids.pop()
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.runner.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.finish_counts[reason.value] = self.finish_counts.get(reason.value, 0) + 1
        if self._forks:
            self._unlink_choice(seq)
        self._prompt_lp.pop(seq.request_id, None)
        if announce:
            self._finished_ids.append(seq.request_id)

    def _unlink_choice(self, seq: Sequence) -> None:
        """A choice that ends before its fork leaves its group; a leader that does hands the
        prompt to the next choice, which is queued at the head in its place."""
        followers = self._forks.pop(seq.request_id, None)
        if followers:
            leader, rest = followers[0], followers[1:]
            if rest:
                self._forks[leader.request_id] = rest
            self.waiting.appendleft(leader)
            return
        for rid, group in list(self._forks.items()):
            if seq in group:
                group.remove(seq)
                if not group:
                    del self._forks[rid]
                return

    # --- offline ----------------------------------------------------------------------------
    def run_to_completion(self, prompts: list[list[int]],
                          params: Union[SamplingParams, list[SamplingParams], None] = None,
                          on_tokens: Optional[Callable[[dict[int, int]], None]] = None) -> list[Sequence]:
        """Run requests of checked token ids to completion; returns their finished sequences
        (token ids only: text is the output processor's, see `LLMEngine.generate`)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            tokens = self.step()
            if on_tokens and tokens:
                on_tokens(tokens)
        self.pop_finished_ids()
        return [self.pop_request(i) for i in ids]
