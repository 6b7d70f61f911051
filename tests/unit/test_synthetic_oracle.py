"""The synthetic runner's next token depends on the KV it reads: wrong KV on a prefix hit, stale
KV from old weights or a flipped byte from the host tier changes the output or raises KVMismatch.

Each injection test runs the same steps on a clean runner and on one whose cache was tampered
with, and asserts that the tampered one does not silently produce the clean one's token.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.engine.runners.synthetic import KVMismatch, SyntheticRunner, next_token, reference_output
from fastkv.sched.output import SeqWork, StepPlan

LAYOUT = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=16, dtype="bfloat16")
A = [11, 12, 13, 14, 15, 16, 17, 18]
B = [21, 22, 23, 24, 25, 26, 27, 28]


def make(verify: str) -> tuple[SyntheticRunner, list[np.ndarray], list[np.ndarray]]:
    k = [np.zeros(LAYOUT.device_shape(16), LAYOUT.numpy_dtype) for _ in range(LAYOUT.num_layers)]
    v = [np.zeros(LAYOUT.device_shape(16), LAYOUT.numpy_dtype) for _ in range(LAYOUT.num_layers)]
    return SyntheticRunner(LAYOUT, 0, 1, k, v, verify=verify), k, v


def prefill(runner: SyntheticRunner) -> None:
    """Request 1 computes A into blocks 0, 1; request 2 computes B into blocks 2, 3."""
    runner.step(StepPlan(0, [SeqWork(1, A, 0, [0, 1], True), SeqWork(2, B, 0, [2, 3], True)]))


# A new request 3 whose prompt is A + [5]: a prefix hit on A's blocks, computing only token 5.
HIT = StepPlan(1, [SeqWork(3, [5], 8, [0, 1, 4], True)])


def tampered_differs(verify: str, tamper) -> str:
    """Runs HIT on a clean and on a tampered runner; how the tampered one differed (or "")."""
    clean, _, _ = make(verify)
    prefill(clean)
    want = clean.step(HIT).sampled[3]
    runner, k, v = make(verify)
    prefill(runner)
    tamper(runner, k, v)
    try:
        got = runner.step(HIT).sampled[3]
    except KVMismatch as exc:
        return f"raised: {exc}"
    return f"output {got} instead of {want}" if got != want else ""


def test_the_clean_output_is_the_reference_computed_without_a_cache():
    runner, _, _ = make("resumed")
    prefill(runner)
    assert runner.step(HIT).sampled == {3: next_token(A + [5], 1024, LAYOUT.dtype)}
    assert reference_output(A, 3, 1024, LAYOUT.dtype)[0] == next_token(A, 1024, LAYOUT.dtype)


@pytest.mark.parametrize("verify", ["resumed", "off"])
def test_another_prompts_block_in_a_prefix_hit_changes_the_output(verify):
    def copy_b_into_a(_runner, k, v):  # block 1 (A's tokens 4..7) now holds B's tokens 4..7
        for a in k + v:
            a[1] = a[3]

    assert tampered_differs(verify, copy_b_into_a)


@pytest.mark.parametrize("verify", ["resumed", "off"])
def test_a_stale_block_from_old_weights_changes_the_output(verify):
    def reload_weights(runner, _k, _v):  # A's blocks were computed under the weights being replaced
        runner.weights_version = "1"

    assert tampered_differs(verify, reload_weights)
    # the same prefix recomputed under the new weights is served without complaint
    runner, _, _ = make(verify)
    runner.weights_version = "1"
    prefill(runner)
    assert runner.step(HIT).sampled == {3: next_token(A + [5], 1024, LAYOUT.dtype, weights_version="1")}


def test_a_flipped_byte_from_the_host_tier_changes_the_output_or_raises():
    """Request 1's blocks make a round trip through a host block (swap out, swap in), which
    holds one flipped bit: in a row's token id (the oracle sees it even with verify "off"),
    or anywhere (verify "resumed" checks every byte of a resumed prefix)."""

    def round_trip(flip):
        def tamper(_runner, k, v):
            host = np.stack([np.stack([k[layer][1], v[layer][1]]) for layer in range(LAYOUT.num_layers)])
            flip(host.view(np.uint8).reshape(host.shape[:-1] + (-1,)))
            for layer in range(LAYOUT.num_layers):
                k[layer][1], v[layer][1] = host[layer, 0], host[layer, 1]
        return tamper

    def token_bit(raw):  # layer 0, K, head 0, slot 2, first header element (token byte 0)
        raw[0, 0, 0, 2, 0] ^= 0x80

    def body_bit(raw):  # layer 1, V, head 1, slot 3, a body byte
        raw[1, 1, 1, 3, 20] ^= 0x01

    assert tampered_differs("off", round_trip(token_bit))
    assert tampered_differs("resumed", round_trip(body_bit)).startswith("raised")


def test_checks_count_what_was_verified_and_read():
    runner, _, _ = make("resumed")
    prefill(runner)
    runner.step(HIT)
    checks = runner.checks()
    assert checks.pop("synthetic_us") > 0
    assert checks == {"kv_blocks_verified": 2, "kv_requests_verified": 1, "kv_positions_read": 8 + 8 + 9,
                      "kv_mismatches": 0, "kv_stale_hits": 0}
    runner.weights_version = "1"
    with pytest.raises(KVMismatch):
        runner.step(StepPlan(2, [SeqWork(4, [6], 8, [0, 1, 5], True)]))
    assert runner.checks()["kv_mismatches"] == 1 and runner.checks()["kv_stale_hits"] == 0


def test_kv_of_older_weights_is_a_stale_hit():
    """After load_weights, a prefix computed under the old weights fails verification as stale."""
    runner, _, _ = make("resumed")
    prefill(runner)
    runner.load_weights("v2")
    with pytest.raises(KVMismatch, match="computed under weights '0'.*stale"):
        runner.step(HIT)
    assert runner.checks()["kv_stale_hits"] == 1 and runner.checks()["kv_mismatches"] == 1


def test_a_request_resumed_again_is_one_verified_request():
    """kv_requests_verified counts distinct requests: request 3, checked on its prefix hit and
    again each time it resumes (here: after a step without it), is one request."""
    runner, _, _ = make("resumed")
    prefill(runner)
    tok = runner.step(HIT).sampled[3]
    for step in range(2, 6, 2):
        runner.step(StepPlan(step, [SeqWork(1, [A[-1]], 7, [0, 1], False)]))  # a step without request 3
        tok = runner.step(StepPlan(step + 1, [SeqWork(3, [tok], 9 + step // 2 - 1, [0, 1, 4], True)])).sampled[3]
    checks = runner.checks()
    # each resume checked its blocks again: the hit's 2, then twice request 1's 2 and request 3's 3
    assert checks["kv_blocks_verified"] == 2 + 2 * (2 + 3), checks
    assert checks["kv_requests_verified"] == 2, checks  # requests 3 and 1, five checks between them
