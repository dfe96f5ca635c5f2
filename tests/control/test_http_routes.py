"""Every route of the HTTP app the controller serves (vLLM's OpenAI server plus pdserve's /pd
routes), called as a client would, answers without a server error: what pdserve does not do is
a 4xx that says why, never a 500."""

from __future__ import annotations

import pytest
from fakepool import fast_settings

PROMPT = "The quick brown fox jumps over the lazy dog."


def requests(model: str) -> dict[str, tuple[str, dict | None]]:
    """A client's request for each route: method and JSON body (None: no body)."""
    chat = [{"role": "user", "content": PROMPT}]
    return {
        "/load": ("GET", None),
        "/version": ("GET", None),
        "/kv_event_sources": ("GET", None),
        "/health": ("GET", None),
        "/metrics": ("GET", None),
        "/ping": ("GET", None),
        "/tokenize": ("POST", {"model": model, "prompt": PROMPT}),
        "/detokenize": ("POST", {"model": model, "tokens": [5, 6, 7]}),
        "/v1/models": ("GET", None),
        "/v1/systemone": ("POST", {"state": {}, "questions": []}),
        "/invocations": ("POST", {"model": model, "prompt": PROMPT, "max_tokens": 4}),
        "/v1/completions": ("POST", {"model": model, "prompt": PROMPT, "max_tokens": 4}),
        "/v1/chat/completions": ("POST", {"model": model, "messages": chat, "max_tokens": 4}),
        "/v1/chat/completions/batch": ("POST", {"model": model, "messages": [chat, chat],
                                                "max_tokens": 4}),
        "/v1/responses": ("POST", {"model": model, "input": PROMPT, "max_output_tokens": 4}),
        "/v1/responses/{response_id}": ("GET", None),
        "/v1/responses/{response_id}/cancel": ("POST", {}),
        "/v1/messages": ("POST", {"model": model, "messages": chat, "max_tokens": 4}),
        "/v1/messages/count_tokens": ("POST", {"model": model, "messages": chat}),
        "/generative_scoring": ("POST", {"model": model, "query": PROMPT, "items": ["yes"],
                                         "label_token_ids": [5, 6]}),
        # vLLM's scale-out routes (off unless --enable-scale-out)
        "/inference/v1/generate": ("POST", {"model": model, "token_ids": [5, 6, 7],
                                            "sampling_params": {"max_tokens": 4}}),
        "/inference/v1/abort_requests": ("POST", {"request_ids": ["x"]}),
        "/v1/completions/render": ("POST", {"model": model, "prompt": PROMPT}),
        "/v1/completions/derender": ("POST", {"model": model, "token_ids": [5, 6]}),
        "/v1/chat/completions/render": ("POST", {"model": model, "messages": chat}),
        "/v1/chat/completions/derender": ("POST", {"model": model, "token_ids": [5, 6]}),
        "/v1/messages/render": ("POST", {"model": model, "messages": chat, "max_tokens": 4}),
        "/v1/responses/render": ("POST", {"model": model, "input": PROMPT}),
        "/scale_elastic_ep": ("POST", {"new_data_parallel_size": 2}),
        "/is_scaling_elastic_ep": ("POST", {}),
        "/pd/workers": ("GET", None),
        "/pd/stats": ("GET", None),
        "/pd/dashboard": ("GET", None),
        "/pd/history": ("GET", None),
    }


@pytest.fixture
async def served(http):
    c, client = await http(fast_settings())
    await c.add("prefill")
    await c.add("decode")
    return client


async def test_every_route_answers_a_client_without_a_server_error(served, vllm_config):
    model = vllm_config.model_config.model
    routes = {r.path for r in served._transport.app.routes if r.path.startswith("/")} - {
        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    calls = requests(model)
    assert routes <= calls.keys(), f"no client request for {sorted(routes - calls.keys())}"
    errors = {}
    for path in sorted(routes):
        method, body = calls[path]
        r = await served.request(method, path.replace("{response_id}", "resp_unknown"),
                                 json=body)
        if r.status_code >= 500:
            errors[path] = (r.status_code, r.text[:200])
    assert not errors


async def test_scaling_through_vllms_elastic_route_is_a_400_naming_pdserves_way(served):
    r = await served.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
    assert r.status_code == 400
    assert "pdserve worker" in r.text
