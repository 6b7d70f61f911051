"""The engine embedded in a server process (docs/WORKER_API.md), on the launch call and the toy
worker of embed_example.py: requests added and aborted from another thread while one thread
drives the engine, and aborts of requests in the states a run puts them in, leaving no block held."""
from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.engine import Engine
from fastkv.launch import launch
from fastkv.run import RunSpec
from fastkv.sched import RequestState as S
from tests.e2e.embed_example import VOCAB, WORKER

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _spec(tmp_path, device_blocks: int) -> RunSpec:
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32")
    return RunSpec(f"emb{uuid.uuid4().hex[:8]}", layout, device_blocks, 64, out_dir=str(tmp_path / "out"),
                   heartbeat_s=0.2, dead_after_s=5.0)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, int(k)).tolist() for k in rng.integers(6, 14, n)]


def _no_block_held(engine: Engine) -> None:
    assert engine.cache.request_ids() == [] and engine.transfer.pending == 0
    assert engine.cache.num_free_device_blocks == engine.spec.num_device_blocks


def test_requests_added_and_aborted_from_another_thread(tmp_path):
    spec = _spec(tmp_path, 12)
    prompts = _prompts(12)
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready()
            added = threading.Event()
            errors = []

            def client() -> None:  # what an asyncio server's handlers do, from their own thread
                try:
                    for i, prompt in enumerate(prompts):
                        engine.add_request(prompt, 10, request_id=f"c{i}", preemption="offload")
                        if i % 3 == 2:  # queued for the next step (unless it finished already)
                            engine.abort(f"c{i - 1}")
                    with pytest.raises(ValueError, match="already in use"):
                        engine.add_request(prompts[0], 10, request_id="c0")
                    assert not engine.abort("never-added")
                except BaseException as exc:  # reported by the driving thread
                    errors.append(exc)
                finally:
                    added.set()

            producer = threading.Thread(target=client)
            producer.start()
            results = {}
            while not (added.is_set() and not engine.has_work()):
                if not engine.has_work():
                    engine.wait_for_work(0.2)
                    continue
                for result in engine.step_stream().finished:
                    results[result.id] = result
            producer.join()
            assert not errors, errors
            aborted = {f"c{i - 1}" for i in range(len(prompts)) if i % 3 == 2}
            assert sorted(results) == sorted(f"c{i}" for i in range(len(prompts)))
            # every abort counts: each is queued while its request has yet to run 10 steps (it was
            # added one add_request before), so it must end aborted, none of the others
            assert {r for r, res in results.items() if res.finish == "aborted"} == aborted
            assert all(len(res.output) == 10 for r, res in results.items() if r not in aborted)
            _no_block_held(engine)
        finally:
            engine.close()


def test_aborts_in_the_states_a_run_reaches_leave_no_block_held(tmp_path):
    """Each step, one request in each state not aborted in yet is aborted (the scheduler machine
    covers every state exhaustively; here the real engine, copies and workers)."""
    spec = _spec(tmp_path, 10)
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec, check=True)
        try:
            engine.wait_until_ready()
            for i, prompt in enumerate(_prompts(16)):
                engine.add_request(prompt, 14, request_id=f"r{i}", preemption="offload")
            hit: dict[S, str] = {}
            results = {}
            while engine.has_work():
                for result in engine.step_stream().finished:
                    results[result.id] = result
                for rid, req in list(engine.sched.requests.items()):
                    if req.state not in hit and req.state in (S.WAITING, S.LOADING, S.RUNNING, S.OFFLOADING,
                                                              S.OFFLOADED):
                        hit[req.state] = engine._ext[rid]
                        assert engine.abort(engine._ext[rid])
            assert {S.WAITING, S.RUNNING, S.OFFLOADED} <= set(hit), hit
            assert all(results[r].finish == "aborted" for r in hit.values()), {r: results[r].finish for r in hit}
            assert len(results) == 16
            _no_block_held(engine)
        finally:
            engine.close()


def test_an_asyncio_server_streams_tokens_from_the_engine_thread(tmp_path):
    """docs/WORKER_API.md's pattern: the engine in a thread of its own, requests added from the
    event loop's handlers, each request's tokens streamed to its asyncio.Queue step by step."""
    import asyncio

    spec = _spec(tmp_path, 12)
    prompts = _prompts(6)

    def engine_thread(engine, loop, queues, stop):
        while not stop.is_set():
            if not engine.has_work():
                engine.wait_for_work(0.2)
                continue
            update = engine.step_stream()
            for rid, tokens in update.tokens.items():
                loop.call_soon_threadsafe(queues[rid].put_nowait, tokens)
            for result in update.finished:
                loop.call_soon_threadsafe(queues[result.id].put_nowait, result)

    async def handle(engine, queues, i, prompt):
        rid = f"a{i}"
        queues[rid] = asyncio.Queue()
        engine.add_request(prompt, 8, request_id=rid, preemption="offload", sampling={"seed": i})
        chunks = []
        while not hasattr(item := await queues[rid].get(), "finish"):
            chunks.append(item)
        return rid, chunks, item

    async def serve(engine):
        loop, queues, stop = asyncio.get_running_loop(), {}, threading.Event()
        driver = threading.Thread(target=engine_thread, args=(engine, loop, queues, stop))
        driver.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(handle(engine, queues, i, p)
                                                           for i, p in enumerate(prompts))), 120)
        finally:
            stop.set()
            driver.join()

    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready()
            served = asyncio.run(serve(engine))
        finally:
            engine.close()
    from tests.e2e.embed_example import reference

    for rid, chunks, result in served:
        i = int(rid[1:])
        assert result.finish == "length" and result.output == reference(prompts[i], 8, i, 1.0)
        assert [t for c in chunks for t in c] == result.output and len(chunks) == 8, (rid, chunks)
