"""``dflash2 serve`` and ``python -m server``: the same flags, and the graceful drain on SIGTERM of a real
server process (embedded SmolLM2)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from dflash2.cli import build_parser as dflash2_parser
from dflash2.cli import engine_config_from_args
from server.__main__ import build_parser as server_parser
from server.settings import ServerSettings, settings_from_args
from tests.server.conftest import wait_until


def option_strings(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_dflash2_serve_and_python_m_server_take_the_same_flags():
    serve = dflash2_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = option_strings(serve)
    assert flags == option_strings(server_parser())  # --log-level included: both accept it after the command
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-concurrency", "--metrics-compat",
                 "--max-body-bytes", "--drain-timeout", "--model", "--max-num-seqs", "--block-size"):  # fmt: skip
        assert flag in flags, flag


def test_flags_build_the_settings():
    argv = ["serve", "--port", "9001", "--api-key", "k", "--metrics-compat", "vllm", "--max-concurrency", "3",
            "--served-model-name", "m", "--max-num-seqs", "4", "--max-model-len", "256",
            "--speculative-draft-vocab-size", "2048"]  # fmt: skip
    args = dflash2_parser().parse_args(argv)
    settings = settings_from_args(args, engine_config_from_args(args))
    assert (settings.port, settings.api_key, settings.metrics_compat) == (9001, "k", "vllm")
    assert (settings.max_concurrency, settings.served_model_name) == (3, "m")
    assert (settings.engine.max_num_seqs, settings.engine.max_model_len) == (4, 256)
    assert settings.engine.speculative_draft_vocab_size == 2048
    with pytest.raises(ValueError, match="speculative_draft_vocab_size"):
        engine_config_from_args(dflash2_parser().parse_args(["serve", "--speculative-draft-vocab-size", "0"]))
    lookup = engine_config_from_args(dflash2_parser().parse_args(["serve", "--prompt-lookup-max", "6"]))
    assert (lookup.prompt_lookup_max, lookup.prompt_lookup_min, lookup.prompt_lookup_bounds) == (6, None, (6, 2))
    for argv, message in (
        (["--prompt-lookup-max", "4", "--no-speculative-adaptive"], "needs adaptive speculation"),
        (["--prompt-lookup-min", "3", "--block-size", "1"], "runs beside a drafter"),
        (["--prompt-lookup-max", "17"], "at most|… 16"),
    ):
        with pytest.raises(ValueError, match=message):  # before any model loads
            engine_config_from_args(dflash2_parser().parse_args(["serve", *argv]))
    defaults = settings_from_args(server_parser().parse_args([]), engine_config_from_args(args))
    assert (defaults.host, defaults.port, defaults.api_key) == ("127.0.0.1", 8000, None)
    assert defaults.default_parallel_tool_calls is False
    keep = dflash2_parser().parse_args(["serve", "--timeout-keep-alive", "120"])
    assert settings_from_args(keep, engine_config_from_args(keep)).timeout_keep_alive == 120
    parallel = dflash2_parser().parse_args(["serve", "--default-parallel-tool-calls"])
    assert settings_from_args(parallel, engine_config_from_args(parallel)).default_parallel_tool_calls is True
    with pytest.raises(SystemExit):
        dflash2_parser().parse_args(["serve", "--metrics-compat", "sglang"])
    with pytest.raises(ValueError, match="max_concurrency"):
        ServerSettings(max_concurrency=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tmp_path: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w")
    # Eager: compiling would add a minute or two to start-up and nothing to draining (tests/integration
    # /test_compiled.py covers the compiled forwards).
    command = [sys.executable, "-m", "server", "--port", str(port), "--max-num-seqs", "2", "--max-model-len", "256",
               "--threads", "1", "--drain-timeout", "60", "--enforce-eager"]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        wait_until(lambda: _status(f"{url}/health/ready") == 200, timeout=120, interval=0.2)
        events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(f"{url}/health/ready") == 503, timeout=10)
        assert httpx.get(f"{url}/health/ready").json() == {"status": "draining"}
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        reader.join(timeout=120)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] and "error" not in chunks[-1]
    assert "Traceback" not in (tmp_path / "server.log").read_text(), (tmp_path / "server.log").read_text()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def test_training_commands_offer_only_the_engine_flags_they_use(capsys):
    parser = dflash2_parser()
    for argv in (
        ["train", "--data", "d", "--run-dir", "r", "--out", "o", "--block-size", "4"],  # --train-block-size is meant
        ["train", "--data", "d", "--run-dir", "r", "--out", "o", "--no-selector"],  # --no-train-selector
        ["train", "--data", "d", "--run-dir", "r", "--out", "o", "--drafter", "x"],  # --init-drafter
        ["data", "--out", "d", "--block-size", "4"],
        ["eval", "--out", "o", "--sets", "heldot"],
        ["train", "--data", "d", "--run-dir", "r", "--out", "o", "--speculative-draft-vocab-size", "64"],
        ["eval", "--out", "o", "--prompt-lookup-max", "4"],  # eval verifies full blocks: no policy, no lookup
        ["data", "--out", "d", "--prompt-lookup-min", "2"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    args = parser.parse_args(["train", "--data", "d", "--run-dir", "r", "--out", "o", "--dtype", "float32"])
    config = engine_config_from_args(args)
    assert config.dtype == "float32" and config.drafter is None and config.block_size is None
    args = parser.parse_args(["eval", "--out", "o", "--drafter", "x", "--no-selector", "--max-num-seqs", "2"])
    config = engine_config_from_args(args)
    assert (config.drafter, config.use_selector, config.max_num_seqs) == ("x", False, 2)


def test_eval_of_the_heldout_set_needs_a_data_folder(capsys, tmp_path):
    args = dflash2_parser().parse_args(["eval", "--out", str(tmp_path), "--sets", "heldout"])
    assert args.func(args) == 2
    assert "--data" in capsys.readouterr().err
