"""The engine in a process of its own, for `rose serve-local` on a GPU.

In one process the HTTP event loop and the engine's worker thread share the GIL: every token's
SSE event is Python work on the loop, every decode step Python work on the worker, and each waits
for the other (at 64 streams of W1's shape the server reached ~29% of the in-process
throughput, see docs/performance.md). As in vLLM v1 and SGLang, the engine core (scheduler,
runner, output processing, the streaming manager) then runs in a child process and the server
process does HTTP only. They talk over one duplex `multiprocessing` pipe:

- server -> engine: ``("add", rid, token_ids, params)``, ``("add_group", rids, token_ids, [params])``
  (``n`` choices), ``("abort", rid)``,
  ``("call", call_id, name)`` (``stats``, ``decode_counts``), ``("close",)``;
- engine -> server: ``("ready", info)`` or ``("failed", message)`` once at start-up, then
  ``("out", pieces, ends)`` per batch of the manager's sink (``pieces``: ``[(rid, text)]``,
  ``ends``: ``[(rid, RequestOutput or None, error or None)]``), ``("reply", call_id, value)``,
  ``("dead", message)`` when the engine worker died.

Requests are checked (and counted against ``--max-inflight-requests``) in the server process by
the same `InputProcessor`, so a bad request is refused at once, as in process. The child is
spawned (CUDA cannot be forked), ignores SIGINT (the server shuts it down), and exits when the
pipe closes; if it dies, every open request ends with EngineDeadError and /health says dead.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import pickle
import queue
import signal
import threading
from typing import Optional, Union

from rosecli.engine.config import EngineConfig, SamplingParams
from rosecli.engine.errors import OverloadedError, RequestFailedError
from rosecli.engine.streaming import EngineDeadError
from rosecli.engine.inputs import InputProcessor
from rosecli.engine.outputs import END
from rosecli.engine.block_manager import check_group

log = logging.getLogger("rosecli.server")

START_TIMEOUT_S = 1800.0  # a first start may convert a checkpoint and compile kernels
CALL_TIMEOUT_S = 10.0


class _BlockLimits:
    """What the input processor reads of the block manager (the prompt must fit the KV pool)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class RemoteEngine:
    """What the server reads of an engine (config, inputs, names, sizes) for one in the child."""

    def __init__(self, config: EngineConfig, info: dict):
        import torch

        self.config = config
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.device = torch.device(info["device"])
        self.tokenizer = info["tokenizer"]
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, info["vocab_size"],
                                     _BlockLimits(info["num_blocks"], info["block_size"]))
        self.stages = None  # profiling needs the engine in the server process (serve-local says so)
        self.read_ceiling_gbs: Optional[float] = info.get("read_ceiling_gbs")
        self.decode_weights: dict = info["decode_weights"]  # what a decode step reads of the model (bytes)

    def close(self) -> None:
        pass


class RemoteManager:
    """The streaming manager's interface, as the server uses it, for an engine in the child."""

    def __init__(self, conn, proc, config: EngineConfig, inputs: InputProcessor):
        self._conn = conn
        self._proc = proc
        self.inputs = inputs
        self.config = config
        self.max_inflight = config.max_inflight_requests
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sinks: dict[int, queue.SimpleQueue] = {}
        self._outputs: dict[int, tuple] = {}  # rid -> (RequestOutput or None, error or None), after END
        self._aborted: set[int] = set()  # open requests aborted: their outputs are not kept (nobody takes them)
        self._calls: dict[int, list] = {}
        self._call_ids = itertools.count()
        self._inflight = 0
        self._closed = False
        self._last_stats: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self._reader = threading.Thread(target=self._read, name="rose-engine-reader", daemon=True)
        self._reader.start()

    # --- the manager's interface ----------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.error is None and not self._closed and self._proc.is_alive()

    def health(self) -> dict:
        if self.error is not None:
            return {"status": "dead", "error": f"{type(self.error).__name__}: {self.error}"}
        if self._closed or not self._proc.is_alive():
            return {"status": "stopped", "error": "the engine was shut down"}
        return {"status": "ok", "error": None}

    def add_request(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                    wait: bool = False, timeout: Optional[float] = None,
                    sink: Optional[queue.SimpleQueue] = None) -> int:
        """As `StreamingManager.add_request` in sink mode (the server's): checks the request here,
        refuses it beyond ``--max-inflight-requests`` (OverloadedError; ``wait`` is not
        supported: the server waits itself), and hands it to the engine."""
        if sink is None:
            raise ValueError("RemoteManager serves sink-mode requests only")
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        params = params or SamplingParams()
        token_ids = self.inputs.process(prompt, params)
        with self._lock:
            if self.max_inflight is not None and self._inflight >= self.max_inflight:
                raise OverloadedError(f"{self._inflight} requests are in flight, the limit set by "
                                      f"--max-inflight-requests is {self.max_inflight}: retry later")
            rid = next(self._ids)
            self._sinks[rid] = sink
            self._inflight += 1
        try:
            self._send(("add", rid, token_ids, params))
        except BaseException:
            with self._lock:
                self._sinks.pop(rid, None)
                self._inflight -= 1
            raise
        return rid

    def add_choices(self, prompt: Union[str, list[int]], params: list[SamplingParams], wait: bool = False,
                    timeout: Optional[float] = None, sink: Optional[queue.SimpleQueue] = None) -> list[int]:
        """As `StreamingManager.add_choices` in sink mode: the ``n`` choices of one prompt, checked
        here (``n`` against the engine's batch and KV pool too), one id each."""
        if sink is None:
            raise ValueError("RemoteManager serves sink-mode requests only")
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error or 'it was shut down'}")
        token_ids = self.inputs.process(prompt, params[0])
        for p in params[1:]:
            self.inputs.check_params(p)
        check_group(self.config, self.inputs.block_manager, len(params), len(token_ids))
        with self._lock:
            if self.max_inflight is not None and self._inflight + len(params) > self.max_inflight:
                raise OverloadedError(f"{self._inflight} requests are in flight, the limit set by "
                                      f"--max-inflight-requests is {self.max_inflight}: retry later")
            rids = [next(self._ids) for _ in params]
            for rid in rids:
                self._sinks[rid] = sink
            self._inflight += len(rids)
        try:
            self._send(("add_group", rids, token_ids, params))
        except BaseException:
            with self._lock:
                for rid in rids:
                    self._sinks.pop(rid, None)
                self._inflight -= len(rids)
            raise
        return rids

    def abort(self, rid: int) -> bool:
        """Discard request ``rid``: its caller will not take its output (kept neither here nor, once it
        ends, when it arrives). False when it had ended already."""
        with self._lock:
            if rid not in self._sinks:
                self._outputs.pop(rid, None)  # its END came before the abort
                return False
            self._aborted.add(rid)
        try:
            self._send(("abort", rid))
        except EngineDeadError:
            return False
        return True

    def take_output(self, rid: int):
        with self._lock:
            out, err = self._outputs.pop(rid)
        if err is not None:
            raise err
        return out

    def decode_counts(self) -> dict:
        """As `StreamingManager.decode_counts`, from the engine's process."""
        return self._call("decode_counts")

    def stats(self) -> dict:
        """The engine's counters (as `StreamingManager.stats`); once it is gone, the last ones seen."""
        try:
            self._last_stats = self._call("stats")
        except EngineDeadError:
            if self._last_stats is None:
                raise
        return self._last_stats

    def call_on_worker(self, fn, timeout: Optional[float] = None):
        raise EngineDeadError("this engine runs in its own process: start serve-local with --profile-dir "
                              "(which keeps it in the server process) to profile it")

    def close(self, abort_inflight: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("close",))
        except EngineDeadError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within 30 s: terminating it")
            self._proc.terminate()
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._reader.join(timeout=5)
        self._end_open(EngineDeadError("the engine was shut down before this request finished"))
        self._conn.close()

    # --- plumbing -------------------------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError, EOFError) as e:  # the pipe is gone: so is the engine
            raise EngineDeadError(f"the engine process is gone ({type(e).__name__})") from None

    def _call(self, name: str):
        call_id = next(self._call_ids)
        box: list = [threading.Event()]
        self._calls[call_id] = box
        try:
            self._send(("call", call_id, name))
            if not box[0].wait(CALL_TIMEOUT_S):
                raise EngineDeadError(f"the engine process did not answer {name} within {CALL_TIMEOUT_S:g} s")
        finally:
            self._calls.pop(call_id, None)
        if len(box) < 3:
            raise EngineDeadError(f"the engine stopped before answering {name}")
        if box[2] is not None:
            raise RuntimeError(f"the engine process could not answer {name}: {box[2]}")
        return box[1]

    def _read(self) -> None:
        conn = self._conn
        try:
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "out":
                    self._deliver(msg[1], msg[2])
                elif kind == "reply":
                    box = self._calls.get(msg[1])
                    if box is not None:
                        box.append(msg[2])
                        box.append(msg[3])
                        box[0].set()
                elif kind == "dead":
                    self.error = EngineDeadError(msg[1])
                elif kind == "closed":
                    break
        except (EOFError, OSError) as e:
            if not self._closed and self.error is None:
                self.error = EngineDeadError(f"the engine process died (exit code {self._proc.exitcode}, "
                                             f"{type(e).__name__})")
        finally:
            for box in list(self._calls.values()):
                box[0].set()
            if self.error is not None or self._closed:
                self._end_open(self.error or EngineDeadError("the engine was shut down"))

    def _deliver(self, pieces: list, ends: list) -> None:
        sinks = self._sinks
        for rid, piece in pieces:
            sink = sinks.get(rid)
            if sink is not None:
                sink.put((rid, piece))
        for rid, out, err in ends:
            with self._lock:
                sink = sinks.pop(rid, None)
                if sink is None:
                    continue
                if rid in self._aborted:
                    self._aborted.discard(rid)
                else:
                    self._outputs[rid] = (out, err)
                self._inflight -= 1
            sink.put((rid, END))

    def _end_open(self, error: BaseException) -> None:
        with self._lock:
            open_ = list(self._sinks.items())
            self._sinks.clear()
            for rid, _ in open_:
                if rid not in self._aborted:
                    self._outputs[rid] = (None, error)
            self._aborted.clear()
            self._inflight = 0
        for rid, sink in open_:
            sink.put((rid, END))


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives the pipe (pickling), else a RequestFailedError in its place (the server
    then tells that request's client it failed, instead of the pipe failing for everyone)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any error that cannot cross: its request still ends
        log.warning("a request's error could not be sent to the server: %s: %s", type(e).__name__, e)
        return RequestFailedError()


def _engine_main(config: EngineConfig, conn) -> None:
    """The child: build the engine (start-up progress on its stderr, the same terminal), then
    serve the pipe until told to close or the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server shuts us down
    from rich.console import Console

    from rosecli.commands.progress import start_engine
    from rosecli.commands.serve import serve_read_ceiling
    from rosecli.engine.gc_pauses import GcPauses, freeze_startup
    from rosecli.engine.roofline import decode_bytes
    from rosecli.engine.streaming import StreamingManager

    try:
        console = Console(stderr=True)
        engine = start_engine(config, console, freeze_gc=False)  # frozen below, once the manager is made too
        ceiling = serve_read_ceiling(engine, lambda msg: console.print(msg, highlight=False, markup=False))
        engine.config.max_inflight_requests = None  # the server process counts requests against the limit
        manager = StreamingManager(engine)
    except BaseException as e:  # noqa: BLE001 - told to the server, which says it in one line
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        conn.close()
        return
    bm = engine.scheduler.block_manager
    conn.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                         "device": str(engine.device), "tokenizer": engine.tokenizer,
                         "vocab_size": engine.inputs.vocab_size, "num_blocks": bm.num_blocks,
                         "block_size": bm.block_size,
                         "read_ceiling_gbs": ceiling.gbs if ceiling is not None else None,
                         "decode_weights": decode_bytes(engine.loaded.model, engine.dtype).as_dict()}))
    freeze_startup()  # what start-up made is never walked by a collection again
    GcPauses()  # collections that stall this process are logged (its stderr is the server's terminal)
    send_lock = threading.Lock()

    def send(msg) -> bool:
        try:
            with send_lock:
                conn.send(msg)
            return True
        except (OSError, ValueError, EOFError):
            return False

    sink: queue.SimpleQueue = queue.SimpleQueue()
    to_api: dict[int, int] = {}  # the manager's request id -> the server's
    from_api: dict[int, int] = {}
    # held while a request is added and its ids mapped: its first piece cannot be translated before
    map_lock = threading.Lock()

    def forward() -> None:
        dead_told = False
        while True:
            try:
                items = [sink.get(timeout=0.25)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(sink.get_nowait())
                except queue.Empty:
                    break
            stop = None in items
            pieces, ends = [], []
            with map_lock:
                pairs = [(to_api.get(item[0]), item) for item in items if item is not None]
            for api_rid, item in pairs:
                rid, piece = item
                if api_rid is None:
                    continue
                if piece is END:
                    with map_lock:
                        to_api.pop(rid, None)
                        from_api.pop(api_rid, None)
                    try:
                        ends.append((api_rid, manager.take_output(rid), None))
                    except BaseException as e:  # noqa: BLE001 - the request's own error, for its stream
                        ends.append((api_rid, None, _portable(e)))
                else:
                    pieces.append((api_rid, piece))
            if (pieces or ends) and not send(("out", pieces, ends)):
                return
            if manager.error is not None and not dead_told:
                dead_told = send(("dead", f"the engine stopped on an error: {type(manager.error).__name__}: "
                                          f"{manager.error}"))
            if stop:
                return

    forwarder = threading.Thread(target=forward, name="rose-engine-forward", daemon=True)
    forwarder.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the server is gone
            kind = msg[0]
            if kind == "add":
                _, api_rid, token_ids, params = msg
                with map_lock:
                    try:
                        if getattr(params, "structured", None) is not None:  # compiled here, not on the
                            engine.structured.compile(params.structured)  # engine's thread at admission
                        rid = manager.add_request(token_ids, params, wait=False, sink=sink)
                    except BaseException as e:  # noqa: BLE001 - this request fails; the engine goes on
                        send(("out", [], [(api_rid, None, _portable(e))]))
                        continue
                    to_api[rid] = api_rid
                    from_api[api_rid] = rid
            elif kind == "add_group":
                _, api_rids, token_ids, params = msg
                with map_lock:
                    try:
                        rids = manager.add_choices(token_ids, params, wait=False, sink=sink)
                    except BaseException as e:  # noqa: BLE001 - these requests fail; the engine goes on
                        send(("out", [], [(api_rid, None, e) for api_rid in api_rids]))
                        continue
                    for rid, api_rid in zip(rids, api_rids):
                        to_api[rid] = api_rid
                        from_api[api_rid] = rid
            elif kind == "abort":
                with map_lock:
                    rid = from_api.get(msg[1])
                if rid is not None:
                    manager.abort(rid)
            elif kind == "call":
                _, call_id, name = msg
                fn = {"stats": manager.stats, "decode_counts": manager.decode_counts}.get(name)
                try:
                    send(("reply", call_id, fn(), None) if fn else ("reply", call_id, None, f"no call {name!r}"))
                except Exception as e:  # noqa: BLE001 - the caller hears of it; the engine goes on
                    send(("reply", call_id, None, f"{type(e).__name__}: {e}"))
            elif kind == "close":
                break
    finally:
        manager.close()
        engine.close()
        sink.put(None)
        forwarder.join(timeout=10)
        send(("closed",))
        conn.close()


def start_engine_process(config: EngineConfig) -> tuple[RemoteManager, RemoteEngine]:
    """Spawn the engine process and wait until its engine is built; a start-up failure is raised
    as RuntimeError with the child's one-line reason."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    # daemonic unless it must start tensor-parallel ranks of its own (a daemon may have no children);
    # either way it exits when the pipe closes
    daemon = getattr(config, "tensor_parallel_size", 1) <= 1
    proc = ctx.Process(target=_engine_main, args=(config, child), name="rose-engine", daemon=daemon)
    proc.start()
    child.close()
    try:
        if not parent.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:g} s")
        msg = parent.recv()
    except EOFError:
        proc.join(timeout=5)
        raise RuntimeError(f"the engine process exited during start-up (exit code {proc.exitcode})") from None
    except BaseException:
        proc.kill()
        proc.join(timeout=5)
        raise
    if msg[0] != "ready":
        proc.join(timeout=10)
        raise RuntimeError(msg[1])
    engine = RemoteEngine(config, msg[1])
    return RemoteManager(parent, proc, config, engine.inputs), engine
