"""A seeded request reproduces in the default bfloat16 mode: the embedded SmolLM2 in bfloat16 with the
shipped drafter, the adaptive policy and the prefix cache on (eager: compiling takes minutes), behind a
real server. Other requests run in between, and the engine's step timings change between the seeded
requests (the adaptive policy's drafting factor, as on a machine whose load comes and goes): in bfloat16
a verify width chosen from them would change the rounding, so the text."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models import loader, source
from dflash2.runner.model_setup import default_drafter_path
from tests.live_server import ServerThread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    drafter_path = default_drafter_path()
    if drafter_path is None:
        pytest.skip("this installation has no shipped drafter")
    folder = source.resolve_model(None)
    tokenizer = loader.load_tokenizer(folder)
    dtype, device = torch.bfloat16, torch.device("cpu")
    target = loader.load_target(folder, dtype, device)
    drafter = loader.load_drafter(drafter_path, target, dtype, device, None)
    config = EngineConfig(device="cpu", dtype="bfloat16", enforce_eager=True, max_num_seqs=2, max_model_len=1024)
    assert config.speculative_adaptive and config.enable_prefix_caching  # the defaults
    engine = Engine(config, target, tokenizer, drafter, loader.eos_token_ids(folder, tokenizer), MODEL)
    with ServerThread(engine) as server:
        yield server


def test_the_same_seeded_request_gives_the_same_text_five_times(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    costs = server.engine.cost_model
    assert costs is not None
    ask = {"messages": [{"role": "user", "content": "Give me a JSON object about cats."}], "temperature": 0.8}
    others = ["Explain what a binary search does.", "Write a haiku about the sea.", "List three prime numbers."]
    texts, logprobs = [], []  # the logprobs show the rounding too: the same bits, not only the same samples
    for i in range(5):
        costs.draft_scale[1] = 4.0 if i % 2 else 0.25  # the drafter as if on busy, then idle cores
        if i % 2:
            stream = client.chat.completions.create(
                model=MODEL, max_tokens=64, seed=11, stream=True, logprobs=True, **ask
            )
            chunks = [c.choices[0] for c in stream if c.choices]
            texts.append("".join(c.delta.content or "" for c in chunks))
            logprobs.append([t.logprob for c in chunks if c.logprobs for t in c.logprobs.content])
        else:
            response = client.chat.completions.create(model=MODEL, max_tokens=64, seed=11, logprobs=True, **ask)
            texts.append(response.choices[0].message.content)
            logprobs.append([t.logprob for t in response.choices[0].logprobs.content])
        for other in (others[i % 3], others[(i + 1) % 3]):  # other traffic, sampled without a seed
            messages = [{"role": "user", "content": other}]
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.8)
    assert len(set(texts)) == 1, texts
    assert all(lp == logprobs[0] for lp in logprobs)
