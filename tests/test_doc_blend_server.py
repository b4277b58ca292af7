"""Document reuse through a real `kvserve serve --blend-config` process and the official openai
client: chat content parts and completion prompt parts marked {"type": "document"} are reused
in another order (cached_tokens counts them, the cache report splits them), an unmarked request
is served as before, and a bad mark is a 400."""

from __future__ import annotations

import random

import openai
import pytest
from server_process import ServerProcess, running


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvserve.model_loader.make_model import ensure_default_model

    proc = ServerProcess("blend", [str(ensure_default_model()), "--dtype", "float32",
                                   "--blend-config", '{"recompute_fraction": 0.2}'],
                         tmp_path_factory.mktemp("blend-logs"), max_model_len=2048)
    with running(proc):
        yield proc


def _docs() -> list[str]:
    rng = random.Random(0)
    words = ["cache", "block", "token", "prefix", "tree", "page", "table", "model", "layer",
             "query", "key", "value", "head", "batch", "step", "pool"]
    return [" ".join(rng.choice(words) for _ in range(120)) for _ in range(3)]


def _doc(text: str) -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "document"}}


def test_chat_documents_are_reused_in_another_order(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    docs = _docs()

    def ask(order: list[int], marked: bool = True):
        parts = [_doc(docs[i]) if marked else {"type": "text", "text": docs[i]} for i in order]
        return client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": "Answer from the passages."},
                      {"role": "user", "content": [*parts, {"type": "text",
                                                            "text": "Which word is first?"}]}],
            extra_body={"kv_cache_report": True})

    ask([0, 1, 2])  # the documents are stored
    second = ask([2, 0, 1])
    report = second.model_extra["kv_cache_report"]["documents"]
    assert report["reused_tokens"] > 200 and report["recomputed_tokens"] > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= report["reused_tokens"]
    plain = ask([1, 0, 2], marked=False)  # unmarked: the prefix cache alone
    assert plain.usage.prompt_tokens_details.cached_tokens < report["reused_tokens"]


def test_completion_prompt_parts_and_bad_marks(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    docs = _docs()
    prompts = [["Passages:\n", _doc(docs[i]), _doc(docs[j]), "\nSummary:"]
               for i, j in ((0, 1), (1, 0))]
    outs = [client.completions.create(model=model, prompt=[
        p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts],
        max_tokens=3, temperature=0) for parts in prompts]
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 200
    with pytest.raises(openai.BadRequestError, match="cache_control must be"):
        client.completions.create(model=model, max_tokens=1, prompt=[
            {"type": "text", "text": "x", "cache_control": {"type": "forever"}}])


def test_metrics_count_blended_requests(server):
    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    lines = [ln for ln in text.splitlines() if ln.startswith("kvserve:doc_blend")]
    blended = [ln for ln in lines if 'event="blended_requests"' in ln and "_total" in ln]
    assert blended and float(blended[0].split()[-1]) >= 2, lines
    assert any(ln.startswith("kvserve:doc_blend_enabled") and ln.endswith(" 1.0")
               for ln in lines), lines


def test_hostile_document_parts_are_refused_and_lose_nothing(server):
    """A document carrying the template markers, a non-text part, a malformed mark: each a
    400 naming the problem, and the server serves the next request as before."""
    import httpx

    bad_chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a \ue000 b", "cache_control": {"type": "document"}}]}],
        "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=bad_chat, timeout=60)
    assert r.status_code == 400 and "U+E000" in r.text, r.text
    for part in ({"type": "image_url", "image_url": "x"},
                 {"type": "text", "text": "x", "cache_control": "document"}):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": [part], "max_tokens": 1})
        assert r.status_code == 400, r.text
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": [{"type": "text", "text": "fine",
                                     "cache_control": {"type": "document"}}], "max_tokens": 1})
    assert r.status_code == 200, r.text
