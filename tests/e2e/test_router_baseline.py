"""The peer path `pdserve bench handoff --router` measures pdserve against is a real P/D path:
two plain vLLM servers with pdserve's CPU connector behind vllm-router. Its decode engine reads
each prompt's KV from the prefill engine, and its streamed answer is one engine's."""

from __future__ import annotations

import os
import re

import pytest
from test_multihost import kv_bytes_per_token
from test_openai import prompt_ids

from pdserve.bench import cluster, scrape


@pytest.fixture(scope="module")
def router(model_dir, tmp_path_factory):
    cores = sorted(os.sched_getaffinity(0))[:2]
    with cluster.RouterDeployment(model_dir, tmp_path_factory.mktemp("router"),
                                  [cores[0], cores[-1]]) as dep:
        dep.start(400)
        yield dep


def stream_text(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[str, str]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    return "".join(c.choices[0].text for c in chunks if c.choices), finish[-1]


def test_the_router_baseline_hands_the_kv_over_and_streams_one_engines_answer(
        router, ref_client, model_dir):
    prompt = prompt_ids(3 * 128 + 5, seed=31415)  # no other test's seed
    reads, read_bytes = scrape.nixl_reads(router.decode_url)
    text, finish = stream_text(router.base_url, model_dir, prompt, max_tokens=16)
    reads_after, read_bytes_after = scrape.nixl_reads(router.decode_url)
    ref = ref_client.completions.create(model=model_dir, prompt=prompt, max_tokens=16,
                                        temperature=0)
    assert (text, finish) == (ref.choices[0].text, ref.choices[0].finish_reason)
    assert reads_after - reads == 1  # the decode engine read this prompt's KV, once
    block = block_size(router.decode_url)
    assert read_bytes_after - read_bytes >= len(prompt) // block * block * kv_bytes_per_token(
        model_dir)


def test_a_plain_vllm_servers_client_gets_only_vllms_kv_transfer_params(router, model_dir):
    """P then D by hand, as a proxy does: the decode server's answer carries no pdserve field
    (the connector reports a read only to a pdserve worker, which asks for it)."""
    prompt = prompt_ids(2 * 128 + 9, seed=27182)  # no other test's seed
    body = {"model": model_dir, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    handed = post_json(router.servers[0].base_url + "/v1/completions", body)["kv_transfer_params"]
    assert handed["remote_block_ids"]  # the prefill engine holds the prompt's KV
    reads, _ = scrape.nixl_reads(router.decode_url)
    answer = post_json(router.decode_url + "/v1/completions",
                       {**body, "max_tokens": 4, "kv_transfer_params": handed})
    assert scrape.nixl_reads(router.decode_url)[0] - reads == 1  # its KV was read
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer.get("kv_transfer_params") is None  # as vLLM's NixlConnector ends a decode


def post_json(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def block_size(base: str) -> int:
    """The engine's KV block size, from vLLM's `vllm:cache_config_info`."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        found = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', r.read().decode(),
                          re.M)
    assert found, "vLLM's server exports no cache_config_info"
    return int(found[1])
