"""One request's state inside the engine."""

from __future__ import annotations

import enum
from typing import Optional

from rosecli.engine.config import SamplingParams


# In `Sequence.token_ids`: a token that a launched decode step is sampling and the scheduler has
# not read back yet (overlap scheduling); never a real token id, never seen outside the engine.
PENDING = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context
    ABORT = "abort"  # discarded by its caller
    ERROR = "error"  # failed on its own (an exception while handling it); the engine goes on


class Sequence:
    """Token ids (prompt then output), its block table and how far its KV is computed.

    The KV of ``token_ids[:num_computed_tokens]`` is in the cache. A step computes the next
    chunk of the rest; when that reaches the end, a new token is sampled and appended.
    """

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "block_table",
                 "num_computed_tokens", "num_cached_tokens", "num_hashed_blocks", "block_hashes",
                 "status", "finish_reason", "arrival_index", "admitted_at", "length_limit", "stop_ids", "stop_from")

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int = 0):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_table: list[int] = []  # replaced by the block manager, never changed in place
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_hashed_blocks = 0
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.arrival_index = arrival_index
        self.admitted_at: Optional[float] = None
        # when it ends, from its parameters (the scheduler that owns it adds the context and EOS:
        # `Scheduler._set_limits`): at ``length_limit`` tokens, or on a token of ``stop_ids`` once it has
        # ``stop_from`` (before min_tokens no stop token ends it, as in vLLM)
        self.length_limit = self.num_prompt_tokens + params.max_new_tokens
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self.stop_from = self.num_prompt_tokens + params.min_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, len={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
