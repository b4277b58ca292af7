"""AsyncLLMEngine in-process: the thread/asyncio handoff, validation errors travelling back,
aborts freeing blocks, the waiting-queue limit, and a failing engine step that fails only the
requests it ran while the loop lives on (also through the HTTP app: a 500 in OpenAI's shape)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineQueueFullError,
                                         EngineStepError)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16, seed=0)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _fresh(engine, **kwargs) -> AsyncLLMEngine:
    """A new AsyncLLMEngine around the module's LLMEngine (one loop thread at a time)."""
    return AsyncLLMEngine(engine, log_stats=False, **kwargs)


def test_generate_streams_and_matches_offline(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]

    async def main():
        ae = _fresh(llm.engine)
        ae.start()
        try:
            seen = []
            async for out in ae.generate("The capital of France is", params, "r1"):
                seen.append(len(out.outputs[0].token_ids))
            final = out
            non_stream = [o async for o in ae.generate("The capital of France is", params, "r2",
                                                       stream=False)]
            return seen, final, non_stream
        finally:
            ae.shutdown()

    seen, final, non_stream = _run(main())
    assert final.finished and final.outputs[0].token_ids == expected.outputs[0].token_ids
    assert final.outputs[0].text == expected.outputs[0].text
    assert seen == sorted(seen) and seen[-1] == 12  # cumulative snapshots (maybe coalesced)
    assert len(non_stream) == 1 and non_stream[0].outputs[0].token_ids == final.outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.usage == 0.0


def test_validation_errors_travel_back_and_nothing_is_queued(llm):
    async def main():
        ae = _fresh(llm.engine)
        ae.start()
        try:
            errors = []
            for prompt, params, salt in [("", None, None),
                                         ({"prompt_token_ids": [1, 10**9]}, None, None),
                                         ("hi", SamplingParams(max_tokens=10_000), None),
                                         ("hi", None, "")]:
                with pytest.raises(ValueError) as info:
                    await ae.add_request("bad", prompt, params, cache_salt=salt)
                errors.append(str(info.value))
            ok = [o async for o in ae.generate("hi", SamplingParams(max_tokens=2), "bad")]
            return errors, ok
        finally:
            ae.shutdown()

    errors, ok = _run(main())
    assert "empty" in errors[0] and "vocabulary" in errors[1]
    assert "context length" in errors[2] and "cache_salt" in errors[3]
    assert ok[-1].finished  # the id was never taken by the refused requests
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_and_duplicate_ids_are_refused(llm):
    async def main():
        ae = _fresh(llm.engine)
        ae.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            rs = await ae.add_request("a", "a long running request", params, stream=True)
            first = await rs.get()
            with pytest.raises(ValueError, match="already in use"):
                await ae.add_request("a", "again", params)
            usage_running = await ae.call(lambda e: e.kv.usage)
            ae.abort("a")
            stats = await ae.stats()  # processed after the abort: commands keep their order
            return first, usage_running, stats
        finally:
            ae.shutdown()

    first, usage_running, stats = _run(main())
    assert not first.finished and usage_running > 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0


def test_waiting_queue_limit(llm):
    async def main():
        ae = _fresh(llm.engine, max_waiting_requests=2)
        ae.start()
        try:
            # Hold the loop thread in a call while the adds queue up behind it, so that they are
            # decided in one batch, before any step admits one of them.
            blocker = asyncio.ensure_future(ae.call(lambda e: time.sleep(0.3)))
            await asyncio.sleep(0.05)
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            results = await asyncio.gather(
                *(ae.add_request(f"q{i}", f"prompt {i}", params) for i in range(5)),
                return_exceptions=True)
            accepted = [r for r in results if not isinstance(r, BaseException)]
            await blocker
            outs = [await _final(rs) for rs in accepted]
            return results, outs
        finally:
            ae.shutdown()

    results, outs = _run(main())
    refused = [r for r in results if isinstance(r, EngineQueueFullError)]
    assert len(refused) == 3 and len(outs) == 2, results
    assert all(o.finished for o in outs)


async def _final(rs):
    while True:
        out = await rs.get()
        if out.finished:
            return out


def test_failing_step_fails_its_requests_and_the_loop_survives(llm, monkeypatch):
    engine = llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def main():
        ae = _fresh(engine)
        ae.start()
        try:
            params = SamplingParams(max_tokens=20, ignore_eos=True)
            rs = await ae.add_request("victim", "this one is running", params, stream=True)
            with pytest.raises(EngineStepError, match="injected kernel failure"):
                while True:
                    await rs.get()
            after = [o async for o in ae.generate("and this one comes later", params, "next")]
            return after, ae.num_step_errors, ae.is_running
        finally:
            ae.shutdown()

    after, num_errors, running = _run(main())
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 20
    assert num_errors == 1 and running
    assert engine.kv.usage == 0.0 and not engine.has_unfinished_requests()


def test_failing_step_is_a_500_over_http_and_the_server_goes_on(llm, monkeypatch):
    from kvserve.server.app import build_app

    engine = llm.engine
    real_step = engine.step
    fail = {"on": True}

    def step():
        if fail["on"]:
            fail["on"] = False
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def main():
        ae = _fresh(engine)
        app = build_app(ae, ["tiny"])
        ae.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
                first = await client.post("/v1/completions", json=body)
                second = await client.post("/v1/completions", json=body)
                health = await client.get("/health")
                return first, second, health
        finally:
            ae.shutdown()

    first, second, health = _run(main())
    assert first.status_code == 500
    err = first.json()["error"]
    assert "boom" in err["message"] and err["type"] == "server_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 4
    assert health.status_code == 200


def test_requests_after_shutdown_are_refused(llm):
    async def main():
        ae = _fresh(llm.engine)
        ae.start()
        ae.shutdown()
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", "hi")
        return ae.is_running

    assert _run(main()) is False


def test_no_per_request_state_outlives_its_request(llm):
    """Issue 11, defect 6 (memory soak): after many requests, half of them left mid-stream, the
    async engine, the engine, the scheduler, the KV manager and the Prometheus logger hold no
    entry for any of them (the maps `/debug/memory` reports must be empty when idle)."""
    from kvserve.server.debug_memory import engine_maps
    from kvserve.server.metrics import PrometheusStatLogger

    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def one(ae, i):
        async for out in ae.generate(f"soak request {i} " * (1 + i % 5), params, f"s{i}"):
            if i % 2 and len(out.outputs[0].token_ids) >= 1 + i % 4:
                return "left"  # leaving the generator aborts the request
        return "done"

    async def main():
        ae = _fresh(llm.engine, stat_loggers=[PrometheusStatLogger("tiny")])
        ae.start()
        try:
            results = await asyncio.gather(*(one(ae, i) for i in range(64)))
            deadline = time.monotonic() + 10
            while ae.engine.has_unfinished_requests() or ae._commands:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await ae.call(lambda e: None)  # the loop has handled every abort
            return results, engine_maps(ae)
        finally:
            ae.shutdown()

    results, maps = _run(main())
    assert results.count("left") == 32 and results.count("done") == 32
    per_request = {k: v for k, v in maps.items() if not k.startswith("prefix.")}
    assert per_request and not any(per_request.values()), per_request
    assert llm.engine.kv.usage == 0.0


def test_idle_work_runs_a_piece_at_a_time_and_requests_go_first(llm):
    """run_when_idle (the server's GEMM warm-up): pieces run on the loop thread only while no
    request is there; a request sent during a piece is served right after it, before the next
    one; a failing piece ends the work, not the loop."""
    import threading

    seen: list[str] = []  # on the loop thread: pieces and engine steps, in order
    go_on = threading.Event()

    def work():
        for i in range(3):
            seen.append(f"piece {i}")
            if i == 0:
                go_on.wait(10)  # hold the first piece until a request is queued
            yield

    class Steps:
        def on_step(self, stats, outputs, streaming, now):
            seen.append("step")

        def on_request_gone(self, request_id):
            pass

        def on_idle(self, stats):
            pass

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        ae = _fresh(llm.engine, stat_loggers=[Steps()])
        ae.run_when_idle(work())
        ae.start()
        try:
            while not seen:
                await asyncio.sleep(0.01)
            task = asyncio.ensure_future(_last(ae.generate("Hello", params, "idle-1")))
            await asyncio.sleep(0.1)  # queued while piece 0 runs
            go_on.set()
            out = await task
            while "piece 2" not in seen:
                await asyncio.sleep(0.01)
            return out, ae._idle_work
        finally:
            ae.shutdown()

    out, left = _run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 3
    assert seen[0] == "piece 0" and seen[-2:] == ["piece 1", "piece 2"] and left is None
    assert set(seen[1:-2]) == {"step"}  # the request's steps, all between pieces 0 and 1
    broken = _fresh(llm.engine)
    broken.run_when_idle(iter(lambda: 1 / 0, None))
    assert broken._idle_piece() is False and broken._idle_work is None


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out
