"""The README opens with the two commands, lists every ``dflash2 serve`` flag, and the deployment guide's
links resolve."""

from __future__ import annotations

import argparse
import re

from dflash2.cli import build_parser
from tests.deploy.conftest import DEPLOY, REPO

README = REPO / "README.md"
SERVER_DOC = REPO / "docs" / "server.md"
# Flags that vLLM / SGLang users expect under these names.
VLLM_SGLANG_NAMES = {
    "--model", "--speculative-draft-model-path", "--speculative-num-draft-tokens", "--served-model-name", "--api-key",
    "--max-num-seqs", "--max-model-len", "--dtype", "--device", "--metrics-compat",
}  # fmt: skip


def serve_flags() -> set[str]:
    """Every long option of ``dflash2 serve``, aliases included."""
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings if opt.startswith("--")} - {"--help"}


def test_readme_starts_with_make_serve_and_make_test():
    blocks = re.split(r"\n\n+", README.read_text().strip())
    assert blocks[0] == "# dflash2"
    assert not blocks[1].startswith(("```", "#"))  # one paragraph of description
    commands = blocks[2].splitlines()
    assert commands[0] == "```bash" and commands[-1] == "```"
    assert [line.split()[:2] for line in commands[1:-1]] == [["make", "serve"], ["make", "test"]]
    after = README.read_text().split(blocks[2], 1)[1]
    assert after.index("curl ") < after.index("from openai import OpenAI") < after.index("\n## ")


def test_every_serve_flag_is_documented():
    flags = serve_flags()
    assert not VLLM_SGLANG_NAMES - flags, VLLM_SGLANG_NAMES - flags
    for doc in (README, SERVER_DOC):
        text = doc.read_text()
        missing = {flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", text)}
        assert not missing, f"{doc.name} does not mention {sorted(missing)}"


def test_deploy_guide_links_resolve():
    guide = DEPLOY / "README.md"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", guide.read_text()):
        if "://" not in target:
            assert (guide.parent / target).exists(), target
