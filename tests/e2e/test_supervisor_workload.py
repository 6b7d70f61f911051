"""The demo workloads: shared prefixes where the design says, deterministic for a seed, valid files."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastkv import workload
from fastkv.workload import ConversationConfig, conversations, read_workload, shared_prefix, write_workload


def by_id(requests):
    return {r["id"]: r for r in requests}


@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3))
def test_turns_extend_the_previous_prompt_and_systems_are_shared(seed, convs, turns, systems):
    cfg = ConversationConfig(conversations=convs, turns=turns, system_prompts=systems, system_tokens=20,
                             user_tokens=(1, 6), reply_tokens=3, max_new_tokens=4, vocab=50, seed=seed)
    reqs = conversations(cfg)
    assert len(reqs) == convs * turns and len(by_id(reqs)) == len(reqs)
    ids = by_id(reqs)
    for c in range(convs):
        for t in range(1, turns):
            prev, cur = ids[f"c{c:03d}t{t - 1}"]["prompt"], ids[f"c{c:03d}t{t}"]["prompt"]
            assert cur[:len(prev)] == prev and len(cur) >= len(prev) + 3 + 1
        # conversations with the same system prompt share exactly its tokens (at least)
        other = c + systems
        if other < convs:
            assert shared_prefix(ids[f"c{c:03d}t0"]["prompt"], ids[f"c{other:03d}t0"]["prompt"]) >= 20
    # turn by turn in the file, FCFS order pinned by arrival
    assert [r["id"][-1] for r in reqs] == sorted(r["id"][-1] for r in reqs)
    assert [r["arrival_s"] for r in reqs] == sorted(r["arrival_s"] for r in reqs)
    assert all(0 <= tok < 50 for r in reqs for tok in r["prompt"])
    assert conversations(cfg) == reqs  # deterministic


def test_seed_changes_tokens_not_shape():
    a, b = conversations(ConversationConfig(seed=1)), conversations(ConversationConfig(seed=2))
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["prompt"] for r in a] != [r["prompt"] for r in b]


def test_turn_gap_spaces_waves():
    reqs = conversations(ConversationConfig(conversations=2, turns=3, turn_gap_s=2.0))
    assert [round(r["arrival_s"]) for r in reqs] == [0, 0, 2, 2, 4, 4]


def test_trace_slice_keeps_the_traces_prefix_sharing():
    rows = [json.loads(line) for line, _ in zip(workload.open_trace(), range(40), strict=False)]
    reqs = workload.trace(40, tokens_per_id=8)
    assert reqs == workload.trace(40, tokens_per_id=8)
    for i in range(40):
        for j in range(i + 1, 40):
            ids_i, ids_j = rows[i]["hash_ids"], rows[j]["hash_ids"]
            common = 0
            while common < min(len(ids_i), len(ids_j)) and ids_i[common] == ids_j[common]:
                common += 1
            got = shared_prefix(reqs[i]["prompt"], reqs[j]["prompt"])
            if common < min(len(ids_i), len(ids_j)):  # shared ids -> shared tokens; a differing id differs
                assert 8 * common <= got < 8 * (common + 1)
    for row, req in zip(rows, reqs, strict=True):
        assert len(req["prompt"]) == 8 * (len(row["hash_ids"]) - 1) + max(
            1, -(-(row["input_length"] - 512 * (len(row["hash_ids"]) - 1)) * 8 // 512))
        assert req["arrival_s"] == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000 / 10)


def test_write_and_read_roundtrip_with_mode(tmp_path):
    reqs = conversations(ConversationConfig(conversations=2, turns=2))
    path = write_workload(reqs, tmp_path / "w.jsonl", "recompute")
    back = read_workload(path)
    assert [r["preemption"] for r in back] == ["recompute"] * 4
    assert [{**r, "preemption": None} for r in back] == reqs


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "arrival_s": 0, "prompt": [], "max_new_tokens": 1}', "non-empty list"),
    ('{"id": "a", "arrival_s": -1, "prompt": [1], "max_new_tokens": 1}', "arrival_s"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": 0}', "max_new_tokens"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1, "preemption": "swap"}', "preemption"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1]}', "lacks"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1, "temp": 1}', "unknown fields"),
    ('[1]', "JSON object"),
    ('{"id": "a", "arrival_s": NaN, "prompt": [1], "max_new_tokens": 1}', "arrival_s must be a finite number"),
    ('{"id": "a", "arrival_s": Infinity, "prompt": [1], "max_new_tokens": 1}', "arrival_s must be a finite number"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1, 18446744073709551616], "max_new_tokens": 1}',
     r"prompt\[1\] = 18446744073709551616 is not a token id in \[0, 2147483648\) \(int32\)"),
    ('{"id": "a", "arrival_s": 0, "prompt": [true], "max_new_tokens": 1}', r"prompt\[0\] = true is not a token id"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": true}', "max_new_tokens must be an int"),
    ('{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1}\n'
     '{"id": "a", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1}', "duplicate"),
])
def test_bad_workload_lines_are_named(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        read_workload(path)
    assert "w.jsonl:" in str(exc.value)
    with pytest.raises(ValueError, match="preemption must be one of"):
        write_workload([], path, "swap")


def test_token_ids_must_be_in_the_runners_vocab(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "arrival_s": 0, "prompt": [5, 1024], "max_new_tokens": 1}\n')
    assert read_workload(path)[0]["prompt"] == [5, 1024]
    with pytest.raises(ValueError, match=r"w.jsonl:1: request 'a': prompt\[1\] = 1024 is not a token id in "
                                         r"\[0, 1024\) \(the vocab of 1024\)"):
        read_workload(path, vocab=1024)
