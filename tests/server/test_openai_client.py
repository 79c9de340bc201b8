"""The official ``openai`` client against uvicorn on loopback serving the embedded SmolLM2 (untrained
default drafter, block size 8): chat and completions, streamed and not, and the serving invariants."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import REAL_MAX_NUM_SEQS, ServerThread, scrape, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], list[str]]:
    """All chunks of a streamed chat completion, and the content deltas."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    return chunks, deltas


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], list[str]]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    deltas = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    return chunks, deltas


def test_chat_non_streaming(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stats = response.model_extra["dflash2"]
    assert set(stats) == {
        "draft_tokens",
        "accepted_tokens",
        "verify_steps",
        "mean_acceptance_length",
        "accepted_tokens_by_source",
    }
    steps, accepted = stats["verify_steps"], stats["accepted_tokens"]
    if choice.finish_reason == "length":  # the prefill gives one token, each verify step accepted + 1 (bonus)
        assert usage.completion_tokens == 1 + steps + accepted
    assert stats["draft_tokens"] >= steps > 0
    assert stats["mean_acceptance_length"] == pytest.approx((accepted + steps) / steps)


def test_seeded_chat_stream_equals_non_stream(client):
    kwargs = {"messages": QUESTION, "max_tokens": 12, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
    full = client.chat.completions.create(model=MODEL, **kwargs)
    chunks, deltas = stream_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert "".join(deltas) == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert finishes[0].model_extra["dflash2"] == full.model_extra["dflash2"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage


def test_completions_stream_non_stream_and_token_ids(client, real_server):
    prompt = "The three primary colors are"
    kwargs = {"max_tokens": 10, "temperature": 0.7, "seed": 7}
    full = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
    _, deltas = stream_completion(client, prompt=prompt, **kwargs)
    assert "".join(deltas) == full.choices[0].text
    ids = httpx.post(f"{real_server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, **kwargs)
    assert by_ids.choices[0].text == prompt + full.choices[0].text
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(by_ids.usage, k) for k in counts] == [getattr(full.usage, k) for k in counts]
    assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # the same prompt as before


@pytest.mark.parametrize(
    ("kind", "prompt"),
    [
        ("completion", "中国的首都是北京。日本的首都是东京。韩国的首都是"),
        ("completion", "😀😃😄😁😆😅😂🤣🥲😊😇🙂🙃😉😌😍🥰"),
        ("chat", "请用中文回答：你好吗？"),
    ],
)
def test_multibyte_text_never_streams_broken_characters(client, kind, prompt):
    if kind == "chat":
        _, deltas = stream_chat(client, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    else:
        _, deltas = stream_completion(client, prompt=prompt, max_tokens=16, temperature=0)
    text = "".join(deltas)
    assert any(ord(ch) > 0x2000 for ch in text), text  # the prompt did elicit multi-byte characters
    assert all("\ufffd" not in delta for delta in deltas), deltas


def test_max_tokens_is_respected(client):
    one = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, temperature=0)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    five = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = five.choices[0].logprobs
    assert five.choices[0].finish_reason == "length"
    assert five.usage.completion_tokens == 5 == len(logprobs.tokens) == len(logprobs.token_logprobs)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)


def test_stop_string_ends_the_text_before_it(client):
    reference = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    text = reference.choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2]
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stop=[stop])
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.message.content == text[: text.index(stop)]
    _, deltas = stream_chat(client, messages=QUESTION, max_tokens=16, temperature=0, stop=stop)
    assert "".join(deltas) == choice.message.content  # nothing of the stop string leaked into a delta


def test_eos_ends_with_finish_reason_stop(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None
    assert "<|im_end|>" not in choice.message.content
    assert response.usage.completion_tokens < 40


def test_two_choices_sum_usage(client):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=True
    )
    assert [c.index for c in response.choices] == [0, 1]
    delivered = sum(len(c.logprobs.content) for c in response.choices)
    assert response.usage.completion_tokens == delivered
    assert response.usage.total_tokens == response.usage.prompt_tokens + delivered
    single = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=1.0, seed=5)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once
    assert response.choices[0].message.content == single.choices[0].message.content  # choice 0 uses the seed


def test_seeded_request_is_the_same_alone_and_among_eight(client):
    def ask(seed: int) -> str:
        messages = [{"role": "user", "content": f"Write a short line about the number {seed}."}]
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=seed
        )
        return response.choices[0].message.content

    alone = ask(42)
    with concurrent.futures.ThreadPoolExecutor(REAL_MAX_NUM_SEQS) as pool:
        futures = [pool.submit(ask, seed) for seed in (42, 1, 2, 3, 4, 5, 6, 7)]
        results = [f.result() for f in futures]
    assert results[0] == alone


def test_metrics_carry_every_metric_and_move(client, real_server):
    before = scrape(real_server.url)
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    after = scrape(real_server.url)
    label = (("model_name", MODEL),)
    for name in (
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "acceptance_length_count",
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "inter_token_latency_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_time_per_output_token_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "request_params_max_tokens_count",
        "iteration_tokens_total_count",
    ):
        key = (f"dflash2_{name}", label)
        assert after[key] > before.get(key, 0), name

    def delta(name: str) -> float:
        return after[(f"dflash2_{name}", label)] - before.get((f"dflash2_{name}", label), 0)

    assert delta("request_params_max_tokens_sum") == 4
    assert delta("request_prompt_tokens_sum") == delta("prompt_tokens_total")
    assert delta("request_generation_tokens_sum") == delta("generation_tokens_total")
    computed = delta("prompt_tokens_total") - delta("prefix_cache_hits_total")  # cached prompt tokens are not run
    assert delta("iteration_tokens_total_sum") == computed + delta("generation_tokens_total")
    assert delta("prefix_cache_queries_total") == delta("prompt_tokens_total")
    assert after[("dflash2_spec_decode_num_accepted_tokens_total", label)] >= 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[(f"dflash2_{gauge}", label)] == 0, gauge
    positions = [k for k in after if k[0] == "dflash2_spec_decode_num_accepted_tokens_per_pos_total"]
    assert len(positions) == 7  # B − 1 draft positions
    success = (("finished_reason", "length"), ("model_name", MODEL))
    assert after[("dflash2_request_success_total", success)] > before.get(("dflash2_request_success_total", success), 0)


class StepCounter:
    """Counts engine steps and notes when a request was aborted and when its slot was freed."""

    def __init__(self, server: ServerThread) -> None:
        self.engine = server.engine
        self.num_steps = 0
        self.aborted_at: int | None = None
        self.freed_at: int | None = None
        self.request_id: str | None = None
        self._lock = threading.Lock()
        self._step, self._abort = self.engine.step, self.engine.abort

    def __enter__(self) -> StepCounter:
        def step():
            with self._lock:
                self.num_steps += 1
            result = self._step()
            rid = self.request_id
            if rid and self.aborted_at is not None and self.freed_at is None and not self.engine.scheduler.find(rid):
                self.freed_at = self.num_steps
            return result

        def abort(request_id: str) -> None:
            with self._lock:
                self.request_id, self.aborted_at = request_id, self.num_steps
            self._abort(request_id)

        self.engine.step, self.engine.abort = step, abort  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.step, self.engine.abort


def assert_freed_within_one_step(server: ServerThread, counter: StepCounter) -> None:
    wait_until(lambda: counter.freed_at is not None)
    assert counter.aborted_at is not None and counter.freed_at is not None
    assert counter.freed_at - counter.aborted_at <= 1, (counter.aborted_at, counter.freed_at)
    wait_until(lambda: scrape(server.url)[("dflash2_num_requests_running", (("model_name", MODEL),))] == 0)
    engine = server.engine
    assert len(engine.scheduler.free_slots) == REAL_MAX_NUM_SEQS and engine.kv_cache_usage == 0


def test_disconnect_mid_stream_frees_the_slot_within_a_step(real_server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, "stream": True}
    with StepCounter(real_server) as counter:
        with httpx.stream("POST", f"{real_server.url}/v1/chat/completions", json=body, timeout=60) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            received = [json.loads(next(events)[6:]) for _ in range(3)]  # the role chunk, then content
        assert received[2]["choices"][0]["delta"]["content"]
        assert_freed_within_one_step(real_server, counter)


def test_disconnect_while_waiting_for_a_full_response_frees_the_slot(real_server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, "ignore_eos": True}
    with StepCounter(real_server) as counter:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{real_server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
        assert_freed_within_one_step(real_server, counter)
