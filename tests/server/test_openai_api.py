"""`shuili serve` through the real OpenAI client: completions and chat, streamed and not, n, stop,
logprobs, and the same bits as `shuili generate` for a seeded request."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import httpx
import pytest
import server_helpers as sh
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The capital of France is"
SEEDED = dict(max_tokens=8, temperature=0.8, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = sh.start("--max-num-seqs", "8", log_path=tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def generated():
    """`shuili generate --json` for the seeded prompt, raw and through the chat template."""
    def run(chat: str):
        cmd = [sys.executable, "-m", "shuili", "generate", *sh.BASE_ARGS, "--json", "--prompt", PROMPT,
               "--chat-template", chat, "--max-tokens", "8", "--temperature", "0.8", "--top-p", "0.9",
               "--seed", "5"]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sh.env(),
                                cwd=sh.ROOT)

    procs = {"off": run("off"), "on": run("on")}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=sh.START_TIMEOUT_S)
        assert p.returncode == 0, stderr
        out[k] = json.loads(stdout.splitlines()[-1])["outputs"][0]  # one prompt, n = 1
    return out


def f32(xs) -> list[bytes]:
    return [struct.pack("<f", x) for x in xs]


def test_models_health_and_fingerprint(server, client):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m"]
    r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
    assert r.system_fingerprint.startswith("reference-hal")
    # no seed given: the seed used is reported and replays the answer
    seed = r.model_extra["seed"]
    again = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2, seed=seed)
    assert again.choices[0].text == r.choices[0].text


def test_seeded_completion_equals_shuili_generate(client, generated):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, logprobs=0,
                                  extra_body={"return_token_ids": True}, **SEEDED)
    ref = generated["off"]
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ref["token_ids"]
    assert f32(c.logprobs.token_logprobs) == f32(ref["logprobs"])
    assert c.text == ref["text"]


def test_seeded_chat_equals_shuili_generate_with_the_chat_template(client, generated):
    r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}],
                                       logprobs=True, extra_body={"return_token_ids": True}, **SEEDED)
    ref = generated["on"]
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ref["token_ids"]
    assert f32([e.logprob for e in c.logprobs.content]) == f32(ref["logprobs"])
    assert c.message.content == ref["text"] and c.message.role == "assistant"


def test_completion_streamed_equals_unstreamed_with_usage(client):
    whole = client.completions.create(model="smollm2-135m", prompt=PROMPT, **SEEDED)
    chunks = list(client.completions.create(model="smollm2-135m", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **SEEDED))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_streamed_n2(client):
    kw = dict(model="smollm2-135m", messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Name a color."}],
              max_tokens=6, temperature=1.0, seed=11, n=2)
    whole = client.chat.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finish) == {0, 1}
    # choice i uses seed + i, so choice 1 is choice 0 of a request seeded one higher
    one = client.chat.completions.create(**{**kw, "n": 1, "seed": 12})
    assert one.choices[0].message.content == texts[1]


def test_stop_string_and_batch_prompt(client):
    r = client.completions.create(model="smollm2-135m", prompt=[PROMPT, PROMPT], stop=["\n"], **SEEDED)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text == " Paris." and c.finish_reason == "stop"


def test_logprobs_and_top_logprobs(client):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, logprobs=3, **SEEDED)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and val <= max(top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True)
        if tok in top:
            assert top[tok] == val
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}],
                                          logprobs=True, top_logprobs=2, **SEEDED)
    for e in chat.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes).decode() == e.token


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def test_metrics_parse_and_move(server, client):
    before = metrics(server.url)
    client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=3, temperature=0.0)
    with pytest.raises(Exception):
        client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=-3)
    after = metrics(server.url)
    for name in ("shuili_generation_tokens_total", "shuili_prompt_tokens_total",
                 "shuili_time_to_first_token_seconds_count", "shuili_e2e_request_latency_seconds_count",
                 "shuili_time_per_output_token_seconds_count", "shuili_request_success_total|finished_reason=length",
                 "shuili_request_errors_total|kind=bad_request", "shuili_prefix_cache_queries_total"):
        assert after[name] > before.get(name, 0), name
    assert after["shuili_generation_tokens_total"] - before["shuili_generation_tokens_total"] == 3
    assert after["shuili_num_requests_running"] == 0 and after["shuili_kv_blocks_used|group=kv"] == 0
    assert after["shuili_kv_blocks_total|group=kv"] > 0
    assert "shuili_prefix_cache_hit_rate" in after and "shuili_num_preemptions_total" in after
