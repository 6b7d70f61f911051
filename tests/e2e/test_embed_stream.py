"""The stream is the single source of truth: with async scheduling (the default), preemption, aborts
and weight updates mid-run, at tp 1 and tp 2, every token of every request reaches the caller exactly
once and in order, through ``step_stream()`` or the ``StepUpdate`` that ``update_weights()`` returns,
and every request is in exactly one update's ``finished``."""
from __future__ import annotations

import uuid
from collections import Counter

import pytest

from fastkv.config import KVLayout
from fastkv.engine import Engine
from fastkv.launch import launch
from fastkv.run import RunSpec
from tests.e2e.embed_example import WORKER, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_token_is_streamed_once_across_weight_updates(tmp_path, tp):
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32", tp_size=tp)
    spec = RunSpec(f"st{uuid.uuid4().hex[:8]}", layout, 16, 64, out_dir=str(tmp_path), heartbeat_s=0.2)
    assert spec.async_scheduling
    prompts = {f"q{i}": [(13 * i + j) % 1000 for j in range(5 + i % 4)] for i in range(12)}
    aborted = {"q3", "q8"}
    streamed: dict[str, list[int]] = {}
    finished: Counter[str] = Counter()
    results = {}
    in_flight_at_update = []

    def take(update) -> None:
        for rid, tokens in update.tokens.items():
            streamed.setdefault(rid, []).extend(tokens)
        for result in update.finished:
            finished[result.id] += 1
            results[result.id] = result

    with launch(spec) as run:
        for rank in range(tp):
            run.start("worker", rank, WORKER)
        engine = Engine.attach(spec, check=True)
        try:
            engine.wait_until_ready(60)
            for rid, prompt in prompts.items():
                engine.add_request(prompt, 10, request_id=rid, preemption="offload", sampling={"seed": 1})
            steps = 0
            while engine.has_work():
                steps += 1
                if steps in (6, 14, 22):
                    in_flight_at_update.append(engine.health()["requests"]["running"])
                    take(engine.update_weights(f"v{steps}"))
                else:
                    take(engine.step_stream())
                if steps == 4:
                    for rid in aborted:
                        assert engine.abort(rid)
            assert engine.weight_updates == 3
        finally:
            engine.close()
    assert max(in_flight_at_update) > 0  # an update came while requests ran
    assert set(finished) == set(prompts) and set(finished.values()) == {1}, finished
    assert sum(r.preemptions for r in results.values()) > 0
    for rid, result in results.items():
        assert streamed.get(rid, []) == result.output, rid
        if rid in aborted:
            assert result.finish == "aborted"
        else:  # the toy model's tokens whatever the preemptions and updates (its weights never change)
            assert result.finish == "length" and result.output == reference(prompts[rid], 10, 1, 1.0), rid
