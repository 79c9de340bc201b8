"""results.json → results.md (markdown tables) and PNG plots.

Everything here reads the results dictionary only, so a report can be rebuilt from a saved
results.json (``write_report(out, json.load(...))``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash2.bench.config import AR, BASELINES, DFLASH2, HF, HF_PLD, LLAMA_CPP
from dflash2.bench.machine import machine_summary

SPEED_PLOT, SERVING_PLOT, ACCEPTANCE_PLOT = "speed_by_method.png", "speedup_vs_concurrency.png", "acceptance.png"
_BASELINE_HEADERS = {AR: "× our AR", HF: "× HF", HF_PLD: "× HF PLD", LLAMA_CPP: "× llama.cpp"}


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number for a table cell; ``–`` for a missing value."""
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def pct(part: float | None, whole: float | None) -> str:
    """``part`` as a percentage of ``whole`` (``–`` when either is missing)."""
    return "–" if part is None or not whole else f"{100 * part / whole:.1f}%"


def mb(num_bytes: int | None) -> str:
    """Bytes as MB (10^6), ``–`` when unknown."""
    return "–" if num_bytes is None else f"{num_bytes / 1e6:.0f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _rows(results: dict[str, Any], scope: str = "all") -> list[dict[str, Any]]:
    return [r for r in results.get("single_stream", {}).get("rows", []) if r["scope"] == scope]


def _methods(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in results.get("single_stream", {}).get("methods", [])}


def conv_overhead_ms(method: dict[str, Any] | None) -> float | None:
    """The measured convolution overhead per drafter forward of a method (None when not measured)."""
    probe = (method or {}).get("conv_probe") or {}
    return probe.get("overhead_ms")


def speed_table(results: dict[str, Any], scope: str = "all") -> list[str]:
    """Tokens/s, ms per token, TTFT, τ, peak RSS and the speedups of every method."""
    methods = _methods(results)
    present = {r["method"] for r in _rows(results, scope)}
    baselines = [b for b in BASELINES if b in present]
    header = ["method", "T", "tok/s (median)", "min–max", "ms/token", "TPOT ms", "TTFT ms", "τ", "peak RSS MB"]
    header += [_BASELINE_HEADERS[b] for b in baselines]
    body = []
    for r in _rows(results, scope):
        method = methods.get(r["method"], {})
        cells = [
            method.get("label", r["method"]),
            f"{r['temperature']:g}",
            fmt(r["tokens_per_second"]),
            f"{fmt(r['tokens_per_second_min'])}–{fmt(r['tokens_per_second_max'])}",
            fmt(r["ms_per_token"]),
            fmt(r["tpot_ms"]),
            fmt(r["ttft_ms"], 0),
            fmt(r["tau"], 2),
            mb(method.get("peak_rss_bytes")),
        ]
        cells += [fmt(r["speedups"].get(b), 2, "×") for b in baselines]
        body.append(cells)
    return table(header, body)


def cost_table(results: dict[str, Any]) -> list[str]:
    """Per decode step of this engine: draft, select, verify, other, and the selector + conv headline."""
    methods = _methods(results)
    header = ["method", "T", "cycle ms", "draft ms", "select ms", "verify ms", "other ms", "conv ms", "select + conv"]
    body = []
    for r in _rows(results):
        if r["cycle_ms"] is None:
            continue
        cycle = r["cycle_ms"]
        conv = conv_overhead_ms(methods.get(r["method"]))
        fused = r.get("select_in_draft", False)
        overhead = None if r["method"] == AR or fused else (r["select_ms"] or 0.0) + (conv or 0.0)
        select = "in draft" if fused else f"{fmt(r['select_ms'], 2)} ({pct(r['select_ms'], cycle)})"
        body.append(
            [
                methods.get(r["method"], {}).get("label", r["method"]),
                f"{r['temperature']:g}",
                fmt(cycle, 2),
                f"{fmt(r['draft_ms'], 2)} ({pct(r['draft_ms'], cycle)})",
                select,
                f"{fmt(r['verify_ms'], 2)} ({pct(r['verify_ms'], cycle)})",
                f"{fmt(r['other_ms'], 2)} ({pct(r['other_ms'], cycle)})",
                f"{fmt(conv, 2)} ({pct(conv, cycle)})" if conv is not None else "–",
                pct(overhead, cycle),
            ]
        )
    return table(header, body)


def headline(results: dict[str, Any]) -> list[str]:
    """One line per DFlash 2 row: selector + convolution overhead as % of the draft–verify cycle."""
    methods = _methods(results)
    lines = []
    for r in _rows(results):
        method = methods.get(r["method"], {})
        if method.get("family") != DFLASH2 or not r["cycle_ms"]:
            continue
        label = f"{method.get('label', r['method'])}, T={r['temperature']:g}"
        if r.get("select_in_draft", False):
            lines.append(
                f"- **{label}: the selector runs inside the compiled drafting graph**, so its time is part of "
                f"the {fmt(r['draft_ms'], 2)} ms of drafting per {fmt(r['cycle_ms'], 2)} ms cycle (τ = "
                f"{fmt(r['tau'], 2)}); the eager row times it apart"
            )
            continue
        conv = conv_overhead_ms(method)
        total = (r["select_ms"] or 0.0) + (conv or 0.0)
        conv_text = f"{fmt(conv, 2)} ms convolutions" if conv is not None else "convolutions not measured"
        lines.append(
            f"- **{label}: selector + convolution overhead "
            f"{pct(total, r['cycle_ms'])} of the draft–verify cycle** ({fmt(r['select_ms'], 2)} ms select + "
            f"{conv_text} of {fmt(r['cycle_ms'], 2)} ms per cycle; τ = {fmt(r['tau'], 2)})"
        )
    return lines


def conv_table(results: dict[str, Any]) -> list[str]:
    """The convolution probe of each DFlash 2 method."""
    body = []
    for m in _methods(results).values():
        probe = m.get("conv_probe")
        if not probe:
            continue
        if "skipped" in probe:
            body.append([m["label"], "–", "–", "–", "–", probe["skipped"]])
            continue
        body.append(
            [
                m["label"],
                str(probe["num_calls"]),
                fmt(probe["with_conv_ms"], 3),
                fmt(probe["without_conv_ms"], 3),
                fmt(probe["overhead_ms"], 3),
                pct(probe["overhead_ms"], probe["with_conv_ms"]),
            ]
        )
    header = ["method", "drafter calls", "forward with conv ms", "without conv ms", "overhead ms", "% of forward"]
    return table(header, body) if body else []


def set_table(results: dict[str, Any]) -> list[str]:
    """tok/s, τ and speedup vs our AR per prompt set."""
    methods = _methods(results)
    scopes = list(dict.fromkeys(r["scope"] for r in results.get("single_stream", {}).get("rows", [])))
    body = []
    for scope in [s for s in scopes if s != "all"]:
        for r in _rows(results, scope):
            body.append(
                [
                    scope,
                    methods.get(r["method"], {}).get("label", r["method"]),
                    f"{r['temperature']:g}",
                    fmt(r["tokens_per_second"]),
                    fmt(r["ms_per_token"]),
                    fmt(r["tau"], 2),
                    fmt(r["speedups"].get(AR), 2, "×"),
                ]
            )
    return table(["set", "method", "T", "tok/s", "ms/token", "τ", "× our AR"], body) if body else []


def method_table(results: dict[str, Any]) -> list[str]:
    """Status, load time and what each method loaded."""
    body = []
    for m in _methods(results).values():
        info = {k: v for k, v in m.get("info", {}).items() if v is not None}
        details = ", ".join(f"{k}={v}" for k, v in info.items())
        body.append([m["id"], m["status"], m.get("message") or "", fmt(m.get("load_seconds")), details])
    return table(["method", "status", "note", "load s", "details"], body)


def serving_table(results: dict[str, Any]) -> list[str]:
    """One row per (server, concurrency) level."""
    body = []
    for lv in results.get("serving", {}).get("levels", []):
        body.append(
            [
                lv["server"],
                str(lv["concurrency"]),
                str(lv["num_requests"]),
                str(lv["num_errors"]),
                fmt(lv["output_tokens_per_second"]),
                fmt(lv["speedup_vs_ar"], 2, "×"),
                fmt(lv["ttft_p50_ms"], 0),
                fmt(lv["ttft_p99_ms"], 0),
                fmt(lv["itl_p50_ms"], 1),
                fmt(lv["itl_p99_ms"], 1),
                fmt(lv["tpot_mean_ms"], 1),
                fmt(lv["tau"], 2),
                fmt(lv["tau_metrics"], 2),
            ]
        )
    header = ["server", "concurrency", "requests", "errors", "output tok/s", "× AR", "TTFT p50 ms", "TTFT p99 ms"]
    header += ["ITL p50 ms", "ITL p99 ms", "TPOT ms", "τ (responses)", "τ (/metrics)"]
    return table(header, body) if body else []


def startup_table(results: dict[str, Any]) -> list[str]:
    """Seconds to ready with an empty and with a warm compile cache, and the time per graph (marked
    "loaded" where a saved graph was loaded instead of compiled)."""
    startup = results.get("startup")
    if not startup:
        return []
    body = []
    for label in ("cold", "warm"):
        run = startup.get(label) or {}
        if "error" in run:
            body.append([label, "–", "–", run["error"]])
            continue
        sources = run.get("graph_sources") or {}
        graphs = ", ".join(
            f"{k} {v:.1f} s{' (loaded)' if sources.get(k) == 'loaded' else ''}"
            for k, v in (run.get("compile_seconds") or {}).items()
        )
        body.append(
            [
                label,
                fmt(run.get("seconds")),
                "yes" if run.get("compiled") else "no",
                graphs or "–",
            ]
        )
    header = [
        f"compile cache (B={startup.get('block_size')}, {startup.get('max_num_seqs')} slots)",
        "seconds to ready",
        "compiled",
        "per graph",
    ]
    return table(header, body)


def agents_table(results: dict[str, Any]) -> list[str]:
    """The agent workload: TTFT of first and follow-up turns and the hit rate, cache on vs off."""
    agents = results.get("agents") or {}
    servers = agents.get("servers", [])
    if not servers:
        return []
    rows = [
        [
            s["server"],
            fmt(s["ttft_first_p50_ms"], 0),
            fmt(s["ttft_first_p99_ms"], 0),
            fmt(s["ttft_followup_p50_ms"], 0),
            fmt(s["ttft_followup_p99_ms"], 0),
            pct(s["cached_tokens"], s["prompt_tokens"]),
            fmt(s["tau"], 2),
            str(s["num_errors"]),
        ]
        for s in servers
    ]
    header = ["server", "TTFT 1st turn p50 ms", "p99", "TTFT follow-up p50 ms", "p99", "hit rate", "τ", "errors"]
    lines = [
        f"{agents['conversations']} conversations × {agents['turns']} turns over a shared "
        f"{agents['history_tokens']}-token system prompt, {agents['max_tokens']} output tokens per answer "
        "(later conversations start after the first one's first answer).",
        "",
        *table(header, rows),
    ]
    if agents.get("followup_ttft_ratio") is not None:
        lines += [
            "",
            f"Follow-up TTFT with the cache: {100 * agents['followup_ttft_ratio']:.0f} % of the cold TTFT "
            f"(p50; first turns: {100 * (agents.get('first_turn_ttft_ratio') or 0):.0f} %).",
        ]
    return lines


def _ratio_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def agent_loop_table(results: dict[str, Any]) -> list[str]:
    """The agent-loop workload: per server and turn kind τ, tok/s p50 and their ratios, tokens, verify
    steps and accepted tokens by draft source; then end to end per server, and the turns that differ from AR."""
    loop = results.get("agent_loop") or {}
    servers = loop.get("servers", [])
    if not servers:
        return []
    rows = []
    for s in servers:
        for kind, k in s["kinds"].items():
            sources = k.get("accepted_by_source") or {}
            rows.append(
                [
                    s["server"],
                    kind,
                    str(k["num_turns"]),
                    fmt(k["tau"], 2),
                    fmt(k["tokens_per_second_p50"], 1),
                    _ratio_cell(k.get("tokens_per_second_vs_ar")),
                    _ratio_cell(k.get("tokens_per_second_vs_base")),
                    str(k["output_tokens"]),
                    str(k["verify_steps"]),
                    f"{k.get('expected_calls', 0)}/{k['num_turns']}" if kind == "tool_call" else "–",
                    " / ".join(str(sources.get(n, 0)) for n in ("drafter", "lookup", "suffix", "grammar"))
                    if sources
                    else "–",
                ]
            )
    header = [
        "server",
        "turn kind",
        "turns",
        "τ",
        "tok/s p50",
        "× AR",
        "× base",
        "tokens",
        "steps",
        "calls as asked",
        "accepted d/l/s/g",
    ]
    e2e = [
        [
            s["server"],
            fmt(s["seconds"], 1),
            _ratio_cell(s.get("speedup_vs_ar")),
            _ratio_cell(s.get("speedup_vs_base")),
            "–" if s.get("num_mismatches") is None else str(s["num_mismatches"]),
            str(s["num_errors"]),
        ]
        for s in servers
    ]
    lines = [
        f"{len(loop['conversations'])} scripted conversations ({', '.join(loop['conversations'])}), "
        f"{loop['turns']} turns, T = 0, at most {loop['max_tokens']} output tokens per reply, one request at a time; "
        "× AR / × base: tok/s p50 against the autoregressive server / against dflash2-base; accepted tokens by "
        "draft source: drafter / lookup / suffix / grammar (– where the server does not report sources); calls as "
        "asked: tool-call turns whose reply made the call the user message asked for.",
        "",
        *table(header, rows),
        "",
        *table(["server", "end to end s", "speedup vs AR", "vs base", "turns ≠ AR", "errors"], e2e),
    ]
    for s in servers:
        for m in s.get("mismatches", [])[:3]:
            lines.append(
                f"- {s['server']} differs from AR at conversation {m['conversation']}, turn {m['turn']} "
                f"({m['kind']}): `{m['output'][:80]!r}` vs `{m['reference'][:80]!r}`"
            )
    return lines


def render_markdown(results: dict[str, Any], plots: Sequence[str] = ()) -> str:
    """The whole report."""
    config = results["config"]
    lines = [
        "# dflash2 bench results",
        "",
        f"- Date: {results['date']}",
        f"- Command: `{results['command']}`",
        f"- Model: {config['model'] or 'embedded SmolLM2-135M-Instruct'}; drafter: {config['drafter'] or 'default'}; "
        f"device {config['device']}, dtype {config['dtype']}",
        f"- Workload: sets {', '.join(results.get('prompt_sets', {}))} "
        f"({', '.join(f'{k}: {v}' for k, v in results.get('prompt_sets', {}).items())} prompts), "
        f"max_tokens {config['max_tokens']}, {config['repeats']} repetition(s) after one warm-up per method, "
        "methods interleaved per repetition",
        "",
        "## Machine",
        "",
        *machine_summary(results["machine"]),
    ]
    if results.get("single_stream"):
        lines += ["", "## Single stream (batch 1), all prompt sets", "", *speed_table(results)]
        lines += ["", "### Cost per draft–verify cycle (this engine, per decode step)", "", *cost_table(results)]
        lines += ["", *headline(results)]
        conv = conv_table(results)
        if conv:
            lines += ["", "### Drafter forward with and without the dynamic convolutions", "", *conv]
        per_set = set_table(results)
        if per_set:
            lines += ["", "### Per prompt set", "", *per_set]
        lines += ["", "### Methods", "", *method_table(results)]
    startup = startup_table(results)
    if startup:
        lines += ["", "## Start-up to ready (speculative engine, a fresh process each)", "", *startup]
    serving = serving_table(results)
    if serving:
        lines += ["", "## Serving (streaming chat, loopback)", "", *serving, ""]
        rounds = results.get("config", {}).get("serving_rounds", 1)
        if rounds > 1:
            lines.append(
                f"- {rounds} rounds per level, the servers' order alternating: output tok/s is the median over "
                "the rounds, × AR the median of the rounds' paired ratios; requests, errors, latencies and τ "
                "cover every round"
            )
        for server, info in results["serving"].get("servers", {}).items():
            lines.append(
                f"- {server}: `{info.get('command', info.get('url'))}`, peak RSS {mb(info.get('peak_rss_bytes'))} MB"
            )
    agents = agents_table(results)
    if agents:
        lines += ["", "## Agent workload (prefix cache)", "", *agents, ""]
    loop = agent_loop_table(results)
    if loop:
        lines += ["", "## Agent loop (tool calls, JSON and text turns)", "", *loop, ""]
    notes = (
        results.get("notes", [])
        + results.get("serving", {}).get("notes", [])
        + results.get("agents", {}).get("notes", [])
        + results.get("agent_loop", {}).get("notes", [])
    )
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    if plots:
        lines += ["", "## Plots", "", *[f"![{p}]({p})" for p in plots]]
    return "\n".join(lines) + "\n"


def write_report(out: Path, results: dict[str, Any]) -> list[Path]:
    """Write results.json, the plots and results.md into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    written[0].write_text(json.dumps(results, indent=2) + "\n")
    plots = write_plots(out, results)
    (out / "results.md").write_text(render_markdown(results, [p.name for p in plots]))
    return [*written, out / "results.md", *plots]


# ---- plots --------------------------------------------------------------------------------------


def write_plots(out: Path, results: dict[str, Any]) -> list[Path]:
    """Speed by method, serving speedup vs concurrency and per-position acceptance (where there is data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, plot in ((SPEED_PLOT, _plot_speed), (SERVING_PLOT, _plot_serving), (ACCEPTANCE_PLOT, _plot_acceptance)):
        figure = plot(results)
        if figure is None:
            continue
        figure.tight_layout()
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        written.append(out / name)
    return written


def _plot_speed(results: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    rows = _rows(results)
    if not rows:
        return None
    methods = list(dict.fromkeys(r["method"] for r in rows))
    temperatures = sorted({r["temperature"] for r in rows})
    index = {(r["method"], r["temperature"]): r for r in rows}
    figure, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(methods) + 2), 4.2))
    width = 0.8 / len(temperatures)
    for k, temperature in enumerate(temperatures):
        xs, ys, low, high = [], [], [], []
        for i, method in enumerate(methods):
            r = index.get((method, temperature))
            if r is None:
                continue
            xs.append(i + (k - (len(temperatures) - 1) / 2) * width)
            ys.append(r["tokens_per_second"])
            low.append(r["tokens_per_second"] - r["tokens_per_second_min"])
            high.append(r["tokens_per_second_max"] - r["tokens_per_second"])
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, label=f"T={temperature:g}")
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_ylabel("output tokens/s (median; bars: min–max)")
    ax.set_title("Single-stream speed by method")
    ax.legend()
    return figure


def _plot_serving(results: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    levels = results.get("serving", {}).get("levels", [])
    if not levels:
        return None
    has_speedup = any(lv["speedup_vs_ar"] is not None and lv["server"] != AR for lv in levels)
    figure, axes = plt.subplots(1, 2 if has_speedup else 1, figsize=(11 if has_speedup else 6, 4), squeeze=False)
    servers = list(dict.fromkeys(lv["server"] for lv in levels))
    ax = axes[0][0]
    for server in servers:
        points = [(lv["concurrency"], lv["output_tokens_per_second"]) for lv in levels if lv["server"] == server]
        ax.plot(*zip(*points), marker="o", label=server)
    _concurrency_axis(ax, levels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving throughput")
    ax.legend()
    if has_speedup:
        ax = axes[0][1]
        for server in [s for s in servers if s != AR]:
            points = [
                (lv["concurrency"], lv["speedup_vs_ar"])
                for lv in levels
                if lv["server"] == server and lv["speedup_vs_ar"] is not None
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=server)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        _concurrency_axis(ax, levels)
        ax.set_ylabel("× autoregressive server")
        ax.set_title("Speedup vs concurrency")
        ax.legend()
    return figure


def _concurrency_axis(ax: Any, levels: list[dict[str, Any]]) -> None:
    concurrency = sorted({lv["concurrency"] for lv in levels})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.minorticks_off()
    ax.set_xlabel("concurrent streams")


def _plot_acceptance(results: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(results) if r["acceptance_per_position"]]
    if not rows:
        return None
    figure, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        rates = r["acceptance_per_position"]
        ax.plot(
            range(1, len(rates) + 1),
            rates,
            marker="o",
            label=f"{r['method']} T={r['temperature']:g} (τ={fmt(r['tau'], 2)})",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(drafts 1..j all accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance (single stream)")
    ax.legend(fontsize=7)
    return figure
