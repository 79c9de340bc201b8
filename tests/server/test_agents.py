"""Agent frameworks pointed at the base URL, unchanged: the real clients from PyPI against a real server
(the embedded SmolLM2 in float32 with speculation on, on loopback).

A 135M model is no agent, so the tests check the protocol, not the wisdom: every forced tool call
arrives valid and is executed by the framework, structured outputs parse into the framework's types,
and the agent loops reach their end. The context is 4096 tokens: the frameworks' own system prompts
are long.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.live_server import ServerThread, SmolLM2

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "agents-test-key"
QUESTION = "What is the weather in Paris?"
CALLS: list[str] = []  # cities the weather tool was called with, across frameworks


def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city's name.
    """
    CALLS.append(city)
    return f"It is sunny and 21 degrees in {city}."


class Forecast(BaseModel):
    """A structured answer."""

    city: str = Field(max_length=24)
    sunny: bool


@pytest.fixture(scope="module")
def agent_server(smollm2: SmolLM2) -> Iterator[ServerThread]:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no trace uploads from the Agents SDK
    engine = smollm2.engine(max_model_len=4096, max_num_seqs=2)
    with ServerThread(engine, api_key=API_KEY) as server:
        yield server


@pytest.fixture
def base_url(agent_server: ServerThread) -> str:
    CALLS.clear()
    return f"{agent_server.url}/v1"


# ---- LangChain ---------------------------------------------------------------------------------


def test_langchain_bind_tools_required(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key=API_KEY, max_tokens=60, temperature=0)
    message = llm.bind_tools([get_weather], tool_choice="any").invoke(QUESTION)  # "any" is sent as "required"
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_langchain_with_structured_output_json_schema(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key=API_KEY, max_tokens=60, temperature=0)
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke(QUESTION)
    assert isinstance(forecast, Forecast)


# ---- pydantic-ai -------------------------------------------------------------------------------


def test_pydantic_ai_tool_and_output_type(base_url):
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    async def run() -> Any:
        async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, output_type=Forecast, tools=[get_weather], model_settings=ModelSettings(max_tokens=60))
            limits = UsageLimits(request_limit=6)
            return await agent.run(QUESTION, model_settings=ModelSettings(temperature=0), usage_limits=limits)

    result = asyncio.run(run())
    assert isinstance(result.output, Forecast)  # came through the forced output tool, so it validated


# ---- smolagents --------------------------------------------------------------------------------


def test_smolagents_tool_calling_agent_one_step(base_url):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: the city's name.
        """
        return get_weather(city)

    model = OpenAIServerModel(model_id=MODEL, api_base=base_url, api_key=API_KEY, max_tokens=60, temperature=0)
    agent = ToolCallingAgent(tools=[weather], model=model, max_steps=1, verbosity_level=0)
    agent.run(QUESTION)
    step = agent.memory.steps[1]  # [task, first action step, …]
    assert step.tool_calls and step.tool_calls[0].name in ("weather", "final_answer")
    assert step.error is None or "max steps" in str(step.error).lower()


# ---- openai-agents -----------------------------------------------------------------------------


def _run_openai_agent(base_url: str, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run() -> Any:
        # The client is closed inside the loop that used it (a pooled connection collected later
        # would try to close itself on a loop that no longer exists).
        async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
            model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            agent = Agent(
                name="forecaster",
                instructions="Answer questions about the weather. Use the tool.",
                tools=[function_tool(get_weather)],
                model=model_class(model=MODEL, openai_client=client),
                # Required for the first turn; the SDK resets it afterwards (reset_tool_choice), so the
                # second turn answers in text. parallel_tool_calls is left to the server (one call a turn):
                # the first turn ends after its call instead of running to max_tokens, which the Responses
                # model would raise on (status incomplete).
                model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
                tool_use_behavior="run_llm_again",
            )
            return await Runner.run(agent, QUESTION, max_turns=4)

    result = asyncio.run(run())
    assert CALLS, "the tool was never called"
    assert isinstance(result.final_output, str) and result.final_output
    # Two turns: the call, then the answer (the tool's result went back to the model).
    assert len(result.raw_responses) == 2


def test_openai_agents_chat_completions(base_url):
    _run_openai_agent(base_url, "chat_completions")


def test_openai_agents_responses_default_model(base_url):
    _run_openai_agent(base_url, "responses")
