"""A toy continuous-batching scheduler that drives a ModelRunner through adversarial plans.

It exists to test runners, not to schedule: every step it picks a random subset of the
unfinished requests, gives each a random-size chunk of its uncomputed tokens (a decode
step when only the last sampled token is left), places blocks at random free ids, and
sometimes preempts an idle request by recompute (blocks freed, optionally keeping a
prefix of full blocks as a prefix-cache hit would). Everything is drawn from ``rng`` and
the runner's sampled tokens, so two ranks driven with the same seed emit the same plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastkv.sched.output import SeqWork, StepPlan


@dataclass(slots=True)
class _Req:
    tokens: list[int]  # prompt + generated
    prompt_len: int
    computed: int = 0  # positions whose KV is in the cache
    blocks: list[int] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(slots=True)
class DriveStats:
    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    max_batch: int = 0


def drive(
    runner,
    prompts: dict[int, list[int]],
    max_new: int,
    rng: np.random.Generator,
    *,
    max_chunk: int = 8,
    preempt_prob: float = 0.0,
    on_step=None,
) -> tuple[dict[int, list[int]], DriveStats]:
    """Run every prompt to ``max_new`` generated tokens; return generated tokens per request id."""
    bs = runner.layout.block_size
    free = list(range(runner.num_device_blocks))
    reqs = {rid: _Req(list(p), len(p)) for rid, p in prompts.items()}
    stats = DriveStats()
    step_id = 0
    while True:
        active = [rid for rid, r in reqs.items() if len(r.generated) < max_new]
        if not active:
            break
        batch = [rid for rid in active if rng.random() < 0.6] or [active[int(rng.integers(len(active)))]]
        stats.max_batch = max(stats.max_batch, len(batch))
        seqs = []
        for rid in batch:
            r = reqs[rid]
            left = len(r.tokens) - r.computed
            n = int(rng.integers(1, min(left, max_chunk) + 1))
            need = -(-(r.computed + n) // bs)
            while len(r.blocks) < need:
                assert free, "toy driver ran out of blocks: give the runner a bigger cache"
                r.blocks.append(free.pop(int(rng.integers(len(free)))))
            seqs.append(
                SeqWork(rid, np.array(r.tokens[r.computed : r.computed + n]), r.computed, np.array(r.blocks),
                        r.computed + n == len(r.tokens))
            )
        out = runner.step(StepPlan(step_id, seqs))
        assert out.step_id == step_id
        if on_step is not None:
            on_step(step_id, seqs)
        step_id += 1
        for s in seqs:
            r = reqs[s.request_id]
            r.computed = s.end_pos
            if s.sample:
                r.tokens.append(out.sampled[s.request_id])
            else:
                assert s.request_id not in out.sampled, "runner sampled a request mid-prompt"
            if len(r.generated) >= max_new:  # finished: its blocks go back dirty, to be reused
                free.extend(r.blocks)
                r.blocks = []
        for rid in active:
            r = reqs[rid]
            if rid not in batch and preempt_prob and rng.random() < preempt_prob and r.computed:
                keep = int(rng.integers(0, r.computed // bs + 1))  # full blocks a prefix hit would keep
                free.extend(r.blocks[keep:])
                del r.blocks[keep:]
                stats.preemptions += 1
                stats.recomputed_tokens += r.computed - keep * bs
                r.computed = keep * bs
    stats.steps = step_id
    return {rid: r.generated[:max_new] for rid, r in reqs.items()}, stats


def solo(runner, prompt: list[int], max_new: int, first_block: int = 0) -> list[int]:
    """The plain run: one prefill of the whole prompt, then one decode step per token, blocks in order."""
    bs = runner.layout.block_size
    table = np.arange(first_block, first_block + -(-(len(prompt) + max_new) // bs))
    tokens, pos, out = list(prompt), 0, []
    while len(out) < max_new:
        n = len(tokens) - pos
        res = runner.step(StepPlan(len(out), [SeqWork(7, np.array(tokens[pos:]), pos, table, True)]))
        pos += n
        tokens.append(res.sampled[7])
        out.append(res.sampled[7])
    return out
