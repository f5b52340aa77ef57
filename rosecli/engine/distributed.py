"""Tensor parallelism: one process per rank, rank 0 the engine, the others its workers.

Rank 0 (the process that runs the command) owns the scheduler, the streaming manager and the
server. It starts ranks 1..N-1 with torch.multiprocessing's ``spawn`` context, and every rank
joins one ``torch.distributed`` group: NCCL on CUDA (rank r on GPU r), gloo on CPU. Each rank
loads its own shard of the model (`rosecli.engine.models.parallel`) and runs the unchanged model
runner on it; the runner's collectives (an all-reduce after each row-parallel layer and the
embedding, an all-gather of the logits) are the only tensor traffic, and CUDA graphs capture them
like any other kernel. Rank 0 alone samples and broadcasts the ids on the device (one small
collective per step), so every rank knows each step's tokens on its own device (overlap
scheduling's pending inputs too) and sampling state kept on rank 0 (grammars) needs no copies.

The step plan. Before rank 0's runner runs a step it sends the plan to each worker, which keeps
a mirror of every live sequence and runs the same step on it. A message is a pickled tuple over a
``multiprocessing`` pipe per worker, and says only what changed: the tokens after those already
sent (a token still pending on the device is sent again once known), a block table only when the
block manager replaced it, and a new request's prompt length and sampling parameters once.
Measured on 2 shared CPU cores (send + receive + unpickle, one worker): 8 us for a one-sequence
decode plan, 64 us for 64 sequences, against 880 and 1370 us for a gloo broadcast of the same
bytes (length then payload) and 18 / 50 us for shared memory with semaphores (which also needs a
read acknowledgement before the buffer is reused). The pipe was kept: it is as cheap as shared
memory and a rank that dies closes it, which the other side sees at once.

Faults. Rank 0 watches every worker's process sentinel on a thread; when one ends unasked, that
thread reports "tensor-parallel rank R died" to the engine's fault listeners (the streaming
manager fails every request, /health says the engine is dead), kills the other workers and
aborts the process group so a collective waiting for the dead rank returns. A worker exits when
its pipe closes (rank 0 ended, however), and is killed by the kernel if rank 0 dies while it is
inside a collective (``PR_SET_PDEATHSIG``, which fires when the *thread* that started them ends:
build the engine on a thread that lives as long as it, as every command does). Workers ignore SIGINT (Ctrl-C reaches the whole
process group; rank 0 decides); ``close`` ends them in order, and multiprocessing terminates
them (daemon processes) if rank 0 exits without it. ``NCCL_NVLS_ENABLE=0`` is set in every process.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_sentinels
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rosecli.engine.config import EngineConfig
from rosecli.engine.errors import ConfigError
from rosecli.engine.models.parallel import TensorParallel, check_divides, set_tensor_parallel
from rosecli.engine.runner import DecodeLaunch, ModelRunner
from rosecli.engine.sequence import PENDING, Sequence
from rosecli.engine.step_plan import StepPlan

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off, in every rank (KINDS.md of the device docs)
INIT_TIMEOUT = datetime.timedelta(minutes=10)
CLOSE_TIMEOUT_S = 2.0  # then the workers are terminated


class RankDiedError(RuntimeError):
    """A tensor-parallel rank ended while the engine ran: the engine cannot go on."""


def check_tensor_parallel(config: EngineConfig, device: torch.device, hf_config) -> None:
    """Refuse a size that does not split the model or exceeds the visible GPUs, before anything starts."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ConfigError(f"--tensor-parallel-size {size} needs {size} GPUs; torch sees "
                          f"{torch.cuda.device_count()}: pass at most that")
    check_divides(hf_config, size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, size: int, device: torch.device, init_method: str) -> None:
    os.environ.update(NCCL_ENV)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=INIT_TIMEOUT)
    set_tensor_parallel(TensorParallel(rank, size, None))


def _leave_group() -> None:
    set_tensor_parallel(None)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group a dead rank broke cannot be left cleanly; the process ends
            pass


def _abort_group() -> None:
    """Make collectives that wait for a dead rank return (NCCL would wait for its timeout)."""
    try:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()
    except Exception:  # noqa: BLE001 - best effort: the group is already broken
        pass


# --- rank 0 ----------------------------------------------------------------------------------

class Workers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them messages, watches and ends them."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 log: Callable[[str], None] = lambda msg: None):
        self.size = config.tensor_parallel_size
        self.error: Optional[str] = None
        self._closing = False
        self._died = threading.Event()
        self._listeners: list[Callable[[BaseException], None]] = []
        self._log = log
        os.environ.update(NCCL_ENV)  # inherited by the spawned ranks too
        ctx = torch.multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs, self.conns = [], []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"rose-tp{rank}", daemon=True,
                            args=(rank, config, str(dtype).removeprefix("torch."), init_method, theirs))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._stop_r, self._stop_w = os.pipe()
        self._monitor = threading.Thread(target=self._watch, name="rose-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            _join_group(0, self.size, device, init_method)
        except BaseException:
            self.close()
            raise

    def add_fault_listener(self, fn: Callable[[BaseException], None]) -> None:
        self._listeners.append(fn)
        if self.error is not None:
            fn(RankDiedError(self.error))

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = wait_sentinels(list(by_sentinel) + [self._stop_r])
        if self._closing or self._stop_r in ready:
            return
        rank, p = by_sentinel[next(s for s in ready if s in by_sentinel)]
        p.join(timeout=1)
        code = p.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit status {code}")
        self.error = (f"tensor-parallel rank {rank} (pid {p.pid}) died ({how}); the engine stopped and every rank "
                      "was ended")
        print(f"error: {self.error}", file=sys.stderr, flush=True)
        self._kill_all()
        self._died.set()
        _abort_group()
        for fn in list(self._listeners):
            try:
                fn(RankDiedError(self.error))
            except Exception:  # noqa: BLE001 - one listener's failure must not keep the others unaware
                pass

    def wait_for_death(self, timeout: float) -> bool:
        """Whether a rank died (the monitor has reported it), waiting up to ``timeout`` seconds."""
        self._died.wait(timeout)
        return self.error is not None

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def send(self, message: tuple) -> None:
        if self.error is not None:
            raise RankDiedError(self.error)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:  # a worker's end closed: it died (the monitor says which)
            self._died.wait(timeout=5)
            raise RankDiedError(self.error or f"a tensor-parallel rank stopped reading ({e})") from None

    def close(self) -> None:
        """End every worker (asked first, then killed) and leave the group."""
        if self._closing:
            return
        self._closing = True
        os.write(self._stop_w, b"x")
        if self.error is None:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("close",)))
                except OSError:
                    pass
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            for p in self.procs:  # a rank inside a collective that rank 0 left (Ctrl-C) never reads "close"
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for conn in self.conns:
            conn.close()
        _leave_group()


class _PlanEncoder:
    """What rank 0 has told the workers of each live sequence, to send only what changed."""

    def __init__(self):
        self._sent: dict[int, tuple[int, list]] = {}  # request id -> (tokens known to the workers, block table)

    def encode(self, seqs: list[Sequence]) -> list[tuple]:
        sent = self._sent
        items = []
        for s in seqs:
            rid, tokens = s.request_id, s.token_ids
            known, table = sent.get(rid, (None, None))
            new = known is None
            base = 0 if new else known
            n = len(tokens)
            confirmed = n
            while confirmed > base and tokens[confirmed - 1] == PENDING:
                confirmed -= 1
            send_table = s.block_table if s.block_table is not table else None
            items.append((rid, base, tokens[base:], send_table, s.num_computed_tokens,
                          (s.num_prompt_tokens, s.params) if new else None))
            sent[rid] = (confirmed, s.block_table)
        return items

    def forget(self, rid: int) -> None:
        self._sent.pop(rid, None)


class _Mirror:
    """A worker's copies of rank 0's live sequences."""

    def __init__(self):
        self.seqs: dict[int, Sequence] = {}

    def apply(self, items: list[tuple]) -> list[Sequence]:
        out = []
        for rid, base, tokens, table, computed, first in items:
            seq = self.seqs.get(rid)
            if first is not None:
                num_prompt, params = first
                seq = Sequence(rid, [], params)
                seq.num_prompt_tokens = num_prompt
                self.seqs[rid] = seq
            del seq.token_ids[base:]
            seq.token_ids.extend(tokens)
            if table is not None:
                seq.block_table = table
            seq.num_computed_tokens = computed
            out.append(seq)
        return out


class TPModelRunner(ModelRunner):
    """The model runner of one rank: the KV pool has as many blocks as the rank with least memory,
    and rank 0 alone samples; the others take its ids."""

    def _decide_num_blocks(self) -> int:
        num = torch.tensor([super()._decide_num_blocks()], dtype=torch.int64, device=self.device)
        dist.all_reduce(num, op=dist.ReduceOp.MIN)
        self._tp_ids = torch.zeros(max(self.config.max_batch_size, self.config.prefill_max_batch_size),
                                   dtype=torch.long, device=self.device)
        return int(num.item())

    def _sample(self, seqs, logits, greedy, *args, **kwargs):
        if dist.get_rank() == 0:
            ids = super()._sample(seqs, logits, greedy, *args, **kwargs)
        else:
            ids = self._tp_ids[:len(seqs)]
        dist.broadcast(ids, src=0)
        return ids


class DriverRunner(TPModelRunner):
    """Rank 0's runner: sends each step (and each release) to the workers, then runs it itself."""

    def __init__(self, *args, workers: Workers, **kwargs):
        self.workers = workers
        self._encoder = _PlanEncoder()
        self._mirroring = False  # start-up (`prepare`) runs the same warm-up on every rank by itself
        super().__init__(*args, **kwargs)

    def prepare(self, progress=None) -> dict[str, float]:
        times = super().prepare(progress)
        self._mirroring = True
        return times

    @contextmanager
    def _rank_faults(self):
        """A collective that fails because a rank died says so (not the transport's words)."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, RankDiedError) or not self.workers.wait_for_death(timeout=3.0):
                raise
            raise RankDiedError(self.workers.error) from e

    def execute(self, plan: StepPlan):
        with self._rank_faults():
            if plan.is_prefill and self._mirroring:
                self.workers.send(("prefill", self._encoder.encode(plan.seqs), plan.num_new_tokens))
            return super().execute(plan)

    def launch_decode(self, plan: StepPlan) -> DecodeLaunch:
        with self._rank_faults():
            if self._mirroring:
                self.workers.send(("decode", self._encoder.encode(plan.seqs)))
            return super().launch_decode(plan)

    def collect(self, launch: DecodeLaunch) -> list[int]:
        with self._rank_faults():
            return super().collect(launch)

    def rerun_decode(self, batch: int, max_context_len: int, eager: bool = False) -> bool:
        self.workers.send(("rerun", batch, max_context_len, eager))
        return super().rerun_decode(batch, max_context_len, eager)

    def release(self, seq: Sequence) -> None:
        if self._mirroring and seq.request_id in self._encoder._sent:
            self._encoder.forget(seq.request_id)
            self.workers.send(("release", seq.request_id))
        super().release(seq)

    def close(self) -> None:
        super().close()
        self.workers.close()


# --- ranks 1..N-1 ----------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: the kernel kills this process when rank 0 dies, even inside a hung collective."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(rank: int, config: EngineConfig, dtype_name: str, init_method: str, conn) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(config.device)
    dtype = getattr(torch, dtype_name)
    if device.type == "cpu":
        torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    torch.manual_seed(config.seed)
    code = 0
    try:
        _join_group(rank, config.tensor_parallel_size, device, init_method)
        from rosecli.engine.loader import load_model

        loaded = load_model(config, device, dtype)
        runner = TPModelRunner(config, loaded.model, loaded.max_model_len, device, dtype)
        runner.eos_token_ids = sorted(set(loaded.eos_token_ids))  # as the scheduler sets rank 0's
        runner.prepare()
        _serve(runner, conn)
    except (EOFError, ConnectionError):  # rank 0 is gone: nothing to report to
        pass
    except BaseException:  # noqa: BLE001 - rank 0 sees this rank end and reports it
        traceback.print_exc()
        code = 1
    finally:
        _leave_group()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: CUDA and gloo threads may still wait on a dead peer


def _serve(runner: ModelRunner, conn) -> None:
    mirror = _Mirror()
    last: Optional[DecodeLaunch] = None
    while True:
        message = pickle.loads(conn.recv_bytes())
        kind = message[0]
        if kind == "decode":
            launch = runner.launch_decode(StepPlan.decode(mirror.apply(message[1])))
            if last is not None:  # as rank 0: the step before is read once the next is launched
                runner.collect(last)
            last = launch
        elif kind == "prefill":
            if last is not None:
                runner.collect(last)
                last = None
            runner.execute(StepPlan.prefill(mirror.apply(message[1]), message[2]))
        elif kind == "release":
            seq = mirror.seqs.pop(message[1], None)
            if seq is not None:
                runner.release(seq)
        elif kind == "rerun":
            runner.rerun_decode(*message[1:])
        elif kind == "close":
            runner.close()
            return
