"""The multi-turn agent workload: time to first token with and without the prefix cache.

Agents resend a long system prompt and a growing history on every turn. This workload starts the
speculative server twice (``--enable-prefix-caching`` and ``--no-enable-prefix-caching``) and runs,
against each, a few conversations that share one long system prompt (a reference document of
``agent_history_tokens`` tokens built from the bundled prompt sets), each for ``agent_turns`` turns
of a new question plus the previous answers. Conversation 0 starts first; the others start when its
first answer arrived, as agents do, so their first turn can reuse the shared system prompt.

Reported per server: TTFT p50 / p99 of first turns and of follow-up turns (a new question on a
known history), the prefix-cache hit rate (cached prompt tokens / prompt tokens, from
``usage.prompt_tokens_details.cached_tokens``) and τ; and the headline ratio: follow-up TTFT with
the cache ÷ the same turns' TTFT without it (cold).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dflash2.bench.config import AR, DFLASH2, BenchConfig
from dflash2.bench.serving import ServerSpec, process_peak_rss_bytes, started_server
from dflash2.bench.stats import median, percentile, ratio

Progress = Callable[[str], None]
PROMPT_FILES = ("multiturn.jsonl", "math.jsonl")


@dataclass
class Turn:
    """One request of a conversation as the client saw it."""

    conversation: int
    turn: int
    ok: bool
    ttft: float = 0.0
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    verify_steps: int = 0
    accepted_tokens: int = 0
    error: str = ""
    text: str = ""


@dataclass
class AgentServerResult:
    """One server's run of the workload."""

    server: str
    prefix_caching: bool
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """TTFT percentiles (ms) of first and follow-up turns, hit rate, τ and errors."""
        ok = [t for t in self.turns if t.ok]
        first = [1000 * t.ttft for t in ok if t.turn == 0]
        later = [1000 * t.ttft for t in ok if t.turn > 0]
        prompt = sum(t.prompt_tokens for t in ok)
        steps = sum(t.verify_steps for t in ok)
        return {
            "server": self.server,
            "prefix_caching": self.prefix_caching,
            "num_turns": len(self.turns),
            "num_errors": len(self.turns) - len(ok),
            "ttft_first_p50_ms": median(first),
            "ttft_first_p99_ms": percentile(first, 99),
            "ttft_followup_p50_ms": median(later),
            "ttft_followup_p99_ms": percentile(later, 99),
            "prompt_tokens": prompt,
            "cached_tokens": sum(t.cached_tokens for t in ok),
            "hit_rate": ratio(sum(t.cached_tokens for t in ok), prompt),
            "tau": ratio(sum(t.accepted_tokens for t in ok) + steps, steps),
        }


def history_text(tokenizer: Any, num_tokens: int) -> str:
    """A reference document of about ``num_tokens`` tokens from the bundled prompt sets (deterministic)."""
    folder = Path(__file__).resolve().parent.parent / "train" / "prompts"
    paragraphs = []
    for name in PROMPT_FILES:
        for line in (folder / name).read_text().splitlines():
            record = json.loads(line)
            paragraphs += [m["content"] for m in record.get("messages", [])] or [record["prompt"]]
    text, section = "", 0
    while len(tokenizer.encode(text)) < num_tokens:
        paragraph = paragraphs[section % len(paragraphs)]
        text += f"\n\n§{section + 1}. {paragraph}"
        section += 1
    return text.strip()


def questions(num_conversations: int, num_turns: int) -> list[list[str]]:
    """Different questions per conversation and turn, from the bundled math prompts."""
    folder = Path(__file__).resolve().parent.parent / "train" / "prompts"
    pool = [json.loads(line)["prompt"] for line in (folder / "math.jsonl").read_text().splitlines()]
    return [[pool[(c * num_turns + t) % len(pool)] for t in range(num_turns)] for c in range(num_conversations)]


async def _turn(client: httpx.AsyncClient, url: str, payload: dict[str, Any], conversation: int, turn: int) -> Turn:
    result = Turn(conversation, turn, ok=True)
    start = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return Turn(conversation, turn, ok=False, error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    return Turn(conversation, turn, ok=False, error=str(chunk["error"]))
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content or choice.get("finish_reason"):
                        first = first or time.perf_counter()
                        result.text += content or ""
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage["prompt_tokens"])
                    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                    result.output_tokens = int(usage["completion_tokens"])
                    info = chunk.get("dflash2") or {}
                    result.verify_steps = int(info.get("verify_steps", 0))
                    result.accepted_tokens = int(info.get("accepted_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Turn(conversation, turn, ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    result.seconds, result.ttft = end - start, (first or end) - start
    return result


async def run_conversations(url: str, model: str, system: str, asked: list[list[str]], max_tokens: int) -> list[Turn]:
    """Every conversation's turns (each sequential); conversations after the first start once the first
    one's first answer arrived."""
    first_answered = asyncio.Event()
    turns: list[Turn] = []

    async def conversation(index: int, client: httpx.AsyncClient) -> None:
        if index:
            await first_answered.wait()
        messages = [{"role": "system", "content": system}]
        for turn, question in enumerate(asked[index]):
            messages.append({"role": "user", "content": question})
            payload = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            result = await _turn(client, url, payload, index, turn)
            turns.append(result)
            if index == 0 and turn == 0:
                first_answered.set()
            if not result.ok:
                return
            messages.append({"role": "assistant", "content": result.text})

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(len(asked))))
        first_answered.set()
    return turns


def agent_max_model_len(config: BenchConfig) -> int:
    """Context for the workload's servers: the history, every turn's question and answer, and slack."""
    needed = config.agent_history_tokens + config.agent_turns * (config.agent_max_tokens + 160) + 256
    return max(config.engine.max_model_len or 0, -(-needed // 256) * 256)


def run_agents(config: BenchConfig, folder: Path, log_dir: Path, progress: Progress) -> dict[str, Any]:
    """The workload against the speculative server with and without the prefix cache (``folder``: the
    model folder, for its tokenizer)."""
    from dflash2.models.loader import load_tokenizer

    tokenizer = load_tokenizer(folder)
    result: dict[str, Any] = {
        "history_tokens": config.agent_history_tokens,
        "conversations": config.agent_conversations,
        "turns": config.agent_turns,
        "max_tokens": config.agent_max_tokens,
        "servers": [],
        "notes": [],
    }
    if config.url is not None:
        result["notes"].append("the agent workload starts its own servers; skipped with --url")
        return result
    speculative = DFLASH2 in config.methods and (config.engine.model is None or config.engine.drafter)
    block = config.serving_block_size if speculative else 1
    name = f"{DFLASH2}-b{block}" if speculative else AR
    system = history_text(tokenizer, config.agent_history_tokens)
    asked = questions(config.agent_conversations, config.agent_turns)
    max_model_len = agent_max_model_len(config)
    engine = replace(config.engine, max_model_len=max_model_len, max_num_seqs=config.agent_conversations)
    run_config = replace(config, engine=engine, concurrency=(config.agent_conversations,))
    for caching in (True, False):
        server = f"{name}, prefix cache {'on' if caching else 'off'}"
        spec = ServerSpec(name, block)
        flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
        try:
            with _server(run_config, spec, flag, log_dir / f"agents-{'on' if caching else 'off'}.log") as running:
                model = httpx.get(f"{running.url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
                turns = asyncio.run(run_conversations(running.url, model, system, asked, config.agent_max_tokens))
                run = AgentServerResult(server, caching, turns)
                summary = run.summary()
                summary["peak_rss_bytes"] = process_peak_rss_bytes(running.process.pid)
                summary["turn_records"] = [asdict(t) | {"text": t.text[:200]} for t in turns]
                result["servers"].append(summary)
                progress(
                    f"agents {server}: follow-up TTFT p50 {_ms(summary['ttft_followup_p50_ms'])}, "
                    f"first-turn TTFT p50 {_ms(summary['ttft_first_p50_ms'])}, hit rate {_pct(summary['hit_rate'])}, "
                    f"{summary['num_errors']} errors"
                )
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            result["notes"].append(f"{server}: {str(exc).splitlines()[0]}")
            progress(f"agents {server} failed: {exc}")
    on = next((s for s in result["servers"] if s["prefix_caching"]), None)
    off = next((s for s in result["servers"] if not s["prefix_caching"]), None)
    if on and off:
        result["followup_ttft_ratio"] = ratio(on["ttft_followup_p50_ms"], off["ttft_followup_p50_ms"])
        result["first_turn_ttft_ratio"] = ratio(on["ttft_first_p50_ms"], off["ttft_first_p50_ms"])
    return result


def _server(config: BenchConfig, spec: ServerSpec, flag: str, log_path: Path) -> Any:
    """``started_server`` with the prefix-cache flag and the workload's context and slots (later flags win)."""
    e = config.engine
    extra = [flag, "--max-model-len", str(e.max_model_len), "--max-num-seqs", str(e.max_num_seqs)]
    return started_server(config, spec, log_path, extra_args=extra)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f} ms"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f} %"
