"""A request as the scheduler sees it: its tokens, its state, its counters.

States are ordered; every transition goes through ``move``, which asserts both the source
the caller expects and the table of legal transitions, and only the request table (table.py)
calls it::

    WAITING --admit--> LOADING --copies done--> RUNNING --eos/length--> FINISHED_*
       ^  \\_____________(ready at once)_________^   |
       |                                            | growth fails: PREEMPTED, then by mode
       +--------- recompute ------ PREEMPTED <------+
                                       | offload / storage
                                       v
                               OFFLOADING --done--> OFFLOADED --restore--> LOADING
                   (failed: recompute; storage mode: release host copies, recompute with prefix hits)

A LOADING request holds device blocks while copies fill them (a prefix from host or storage,
a restore, a write-back of a block it evicted, or a prefilled request's KV from another
instance); it can be preempted (to recompute; a restore back to OFFLOADED, on the host copies it
kept) or aborted like any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from fastkv.cache.keys import ExtraKeys, as_tokens
from fastkv.cache.request_policy import CachePolicy


class RequestState(IntEnum):
    WAITING = 0  # no blocks: never admitted, or preempted to recompute
    LOADING = 1  # device blocks, waiting for its copies
    RUNNING = 2  # device blocks holding its computed tokens: schedulable
    PREEMPTED = 3  # chosen as a victim (transient, inside one scheduler call)
    OFFLOADING = 4  # its blocks are being copied to the host
    OFFLOADED = 5  # host blocks only; restored when admitted again
    FINISHED_STOPPED = 6  # eos or a stop token
    FINISHED_LENGTH = 7  # max_new_tokens or max_model_len
    FINISHED_ABORTED = 8  # abort(), or the scheduler could never run it

    @property
    def is_finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED

    @property
    def in_cache(self) -> bool:
        """The cache manager holds a record (blocks on some tier) of this request."""
        return self in _IN_CACHE


S = RequestState
_IN_CACHE = frozenset({S.LOADING, S.RUNNING, S.OFFLOADING, S.OFFLOADED})
_FINISHED = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED)
_LEGAL: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.LOADING, S.RUNNING, S.FINISHED_ABORTED}),
    S.LOADING: frozenset({S.RUNNING, S.PREEMPTED, S.FINISHED_ABORTED}),
    S.RUNNING: frozenset({S.LOADING, S.PREEMPTED, *_FINISHED}),
    S.PREEMPTED: frozenset({S.WAITING, S.OFFLOADING, S.OFFLOADED}),
    S.OFFLOADING: frozenset({S.OFFLOADED, S.WAITING, S.FINISHED_ABORTED}),
    S.OFFLOADED: frozenset({S.LOADING, S.RUNNING, S.WAITING, S.FINISHED_ABORTED}),
}


class PreemptionMode(IntEnum):
    RECOMPUTE = 1  # drop the KV (full blocks stay cached for prefix reuse), compute it again
    OFFLOAD = 2  # copy every block to the host tier, restore it exactly
    STORAGE = 3  # copy to the host, write full blocks to storage, release the host: resume by prefix hits
    AUTO = 4  # OFFLOAD when the copies are estimated cheaper than recomputing, else RECOMPUTE


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. The engine fills the first fields; the scheduler owns the rest.

    ``output_token_ids`` given at construction are tokens already generated elsewhere (a
    prefill instance's first token); they count toward ``max_new_tokens``.
    """

    request_id: int
    prompt_token_ids: np.ndarray
    max_new_tokens: int
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first and is preempted last (with the priority policy)
    preemption: PreemptionMode | None = None  # per-request override of the deployment's mode
    arrival_time: float | None = None  # None: the scheduler's clock at add_request
    extra: ExtraKeys | None = None  # what besides tokens keys its KV (LoRA, tenant, multimodal)
    cache_policy: CachePolicy | None = None  # tiers it may read, whether it may write (None: all)
    output_token_ids: list[int] = field(default_factory=list)

    state: RequestState = field(default=S.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)  # tokens whose KV is valid on the device
    num_slotted: int = field(default=0, init=False)  # tokens with device slots (the cache's count)
    max_computed: int = field(default=0, init=False)  # high-water mark: below it, compute is recompute
    arrival_seq: int = field(default=-1, init=False)  # queue order (kept across preemptions)
    admit_seq: int = field(default=-1, init=False)  # admission order: victims are the latest admitted
    mode_used: PreemptionMode | None = field(default=None, init=False)  # mode of the last preemption
    stalled_steps: int = field(default=0, init=False)  # steps it waited for in-flight offloads to free blocks
    watermark: float = field(default=0.0, init=False)  # blocks reserved for its growth (decays)
    relief_blocks: int = field(default=0, init=False)  # device blocks its offload will release
    remote_pending: bool = field(default=False, init=False)  # prefilled: KV from the prefill instance not here
    remote_start: int = field(default=0, init=False)  # prefilled: first position the remote KV fills
    local_computed: int = field(default=-1, init=False)  # prefilled: tokens valid once local copies are done
    prefilled: bool = field(default=False, init=False)  # admitted by reserve_for_prefilled
    load_target: int = field(default=0, init=False)  # LOADING: tokens valid once its copies succeed
    abort_requested: bool = field(default=False, init=False)  # abort once its step / remote KV is done
    # async scheduling: it stopped, but a later step in flight still computes for it (discarded)
    finish_pending: RequestState | None = field(default=None, init=False)
    block_ahead: bool = field(default=False, init=False)  # holds the block of a token not sampled yet
    num_preemptions: int = field(default=0, init=False)
    num_recomputed_tokens: int = field(default=0, init=False)
    num_offloads: int = field(default=0, init=False)
    num_restores: int = field(default=0, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    _tokens: np.ndarray = field(init=False, repr=False)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, int) or isinstance(self.request_id, bool):
            raise TypeError(f"request_id must be an int, got {type(self.request_id).__name__}")
        prompt = as_tokens(self.prompt_token_ids, "prompt_token_ids")
        if len(prompt) == 0:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if len(prompt) and int(prompt.min()) < 0:
            raise ValueError(f"request {self.request_id}: negative token id in the prompt")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be an int >= 1, "
                             f"got {self.max_new_tokens!r}")
        outs = [int(t) for t in self.output_token_ids]
        if len(outs) > self.max_new_tokens or any(t < 0 for t in outs):
            raise ValueError(f"request {self.request_id}: output_token_ids {outs[:8]} invalid for "
                             f"max_new_tokens {self.max_new_tokens}")
        if self.preemption is not None:
            self.preemption = PreemptionMode(self.preemption)
        if self.extra is not None and not isinstance(self.extra, ExtraKeys):
            raise TypeError(f"request {self.request_id}: extra must be an ExtraKeys")
        if self.cache_policy is not None and not isinstance(self.cache_policy, CachePolicy):
            raise TypeError(f"request {self.request_id}: cache_policy must be a CachePolicy")
        self.stop_token_ids = frozenset(int(t) for t in self.stop_token_ids)
        self.prompt_token_ids = prompt
        self.output_token_ids = outs
        # One buffer for prompt + outputs: a step's token slice is a view, never a concatenation.
        self._tokens = np.empty(len(prompt) + self.max_new_tokens, np.int32)
        self._tokens[:len(prompt)] = prompt
        self._tokens[len(prompt):len(prompt) + len(outs)] = outs
        self.num_tokens = len(prompt) + len(outs)

    # ------------------------------------------------------------------ queries
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> np.ndarray:
        """Prompt + outputs so far (a read-only view)."""
        v = self._tokens[:self.num_tokens]
        v.flags.writeable = False
        return v

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished

    @property
    def num_new_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    def token_span(self, start: int, stop: int) -> np.ndarray:
        """Tokens at positions ``[start, stop)``: a view into the one buffer, for a step or a growth."""
        return self._tokens[start:stop]

    def append_output(self, token: int) -> None:
        assert self.num_tokens < len(self._tokens), f"request {self.request_id}: output beyond max_new_tokens"
        self._tokens[self.num_tokens] = token
        self.num_tokens += 1
        self.output_token_ids.append(token)


def move(req: Request, dst: RequestState, *expected: RequestState) -> None:
    """The one way a request changes state: assert it is in one of ``expected``, and legal."""
    src = req.state
    assert src in expected, f"request {req.request_id}: {src.name} -> {dst.name}, expected one of " \
                            f"{[s.name for s in expected]}"
    assert dst in _LEGAL.get(src, ()), f"request {req.request_id}: illegal transition {src.name} -> {dst.name}"
    req.state = dst
