"""What output controls cost: the classic workload with default sampling, with
penalties and top logprobs on every request, and with half the requests
JSON-schema constrained (`python -m bench.output_controls`).

    python -m bench.output_controls [--repeats 3] [--baseline-tree DIR]

One SmolLM2 server (bfloat16, default config) per repeat runs the three
variants in turn on the same materialised workload (64 random 128-token
prompts, exponential output lengths capped at 256, EOS ignored, greedy, one
burst). With `--baseline-tree` (a checkout of the commit before the output
controls, native extensions built in place) each repeat first runs the
default variant on that tree's server, so old and new alternate on the same
machine state. Prints output tokens per second per run, the medians, and
each variant's median against the default variant's (and the default's
against the baseline's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from cbserve.v1 import generation_pb2 as gpb

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "integer"},
    },
    "required": ["name", "tags", "score"],
}


def _penalties(msg: gpb.GenerateRequest, index: int) -> None:
    msg.sampling.presence_penalty = 0.5
    msg.sampling.frequency_penalty = 0.5
    msg.sampling.repetition_penalty = 1.1
    msg.logprobs = True
    msg.top_logprobs = 5


def _half_json(msg: gpb.GenerateRequest, index: int) -> None:
    if index % 2 == 0:
        msg.structured.json_schema = json.dumps(SCHEMA)


VARIANTS = {"default": None, "penalties+top_logprobs=5": _penalties, "half JSON schema": _half_json}


def _run(server, workload, shape) -> dict:
    from bench.client import run_grpc_workload_sync

    recs, dur = run_grpc_workload_sync(server.target, workload, progress=False, shape=shape)
    errors = [r.error for r in recs if r.error]
    tokens = sum(r.output_tokens for r in recs)
    return {"tok_s": tokens / dur, "tokens": tokens, "seconds": dur, "errors": len(errors)}


def render(paths: list[Path]) -> str:
    """docs/benchmarks.md's section from result files of this command: every
    run's tok/s, the medians, and the issue's targets."""
    runs: dict[str, list[float]] = {}
    commands = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        a = data["args"]
        flags = f"--repeats {a['repeats']}" + (f" --variants {a['variants']}" if a.get("variants") else "")
        commands.append(f"`python -m bench.output_controls {flags} --baseline-tree DIR`")
        for key, rs in data["runs"].items():
            runs.setdefault(key, []).extend(r["tok_s"] for r in rs)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ref = med["current: default"]
    lines = [
        "## Output controls: what they cost",
        "",
        "The classic workload (64 random 128-token prompts, exponential outputs capped at 256, EOS ignored,",
        "greedy, one burst; SmolLM2 bfloat16; this 2-core machine) with default sampling, with penalties",
        "(presence 0.5, frequency 0.5, repetition 1.1) and top_logprobs=5 on every request, and with every",
        "other request constrained",
        "to a JSON Schema (those end when the object is complete, so that run has fewer tokens). The",
        "baseline is the tree before the output controls (4b83e44, native extensions built in place), its",
        "server and the current one alternating on the same machine. Commands: " + ", ".join(commands) + ".",
        "",
        "| run | output tok/s, each run | median | vs current default |",
        "|---|---|---|---|",
    ]
    for k, v in runs.items():
        each = " / ".join(f"{x:.0f}" for x in v)
        lines.append(f"| {k} | {each} | {med[k]:.0f} | {100 * med[k] / ref:.1f} % |")
    if "baseline: default" in runs:
        pairs = [c / b for b, c in zip(runs["baseline: default"], runs["current: default"])]
        lines += [
            "",
            f"Paired by repeat (each baseline run just before its current one): current / baseline default "
            f"{' / '.join(f'{100 * x:.0f}' for x in pairs)} %, median {100 * statistics.median(pairs):.1f} %.",
        ]
    lines.append("")
    targets = (
        [("default sampling vs the baseline", ref / med["baseline: default"], 0.97)]
        if "baseline: default" in med
        else []
    )
    for name, key, need in (
        ("penalties + top_logprobs=5", "current: penalties+top_logprobs=5", 0.85),
        ("half JSON schema", "current: half JSON schema", 0.80),
    ):
        if key in med:
            targets.append((name, med[key] / ref, need))
    lines += ["| target | measured | need | |", "|---|---|---|---|"]
    for name, got, need in targets:
        lines.append(f"| {name} | {100 * got:.1f} % | >= {100 * need:.0f} % | {'met' if got >= need else 'missed'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.server import CbserveServer
    from bench.workload import WorkloadSpec, materialise

    p = argparse.ArgumentParser(prog="python -m bench.output_controls", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-tree", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--out", default="bench/results/output_controls.json")
    p.add_argument("--report", nargs="+", metavar="JSON", help="write docs/benchmarks.md's section from results")
    a = p.parse_args(argv)
    if a.report:
        from bench.report import splice_section

        splice_section(Path("docs/benchmarks.md"), "output-controls", render([Path(x) for x in a.report]))
        return 0
    workload = materialise(WorkloadSpec(num_requests=a.num_requests, prompt_len=128, cap=a.cap, seed=a.seed))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        servers = [("baseline", a.baseline_tree)] if a.baseline_tree else []
        for label, tree in [*servers, ("current", None)]:
            server = CbserveServer(out.parent / f"output-controls-{label}", "fcfs", tree=tree)
            server.start()
            try:
                chosen = {k: VARIANTS[k] for k in a.variants.split(",")}
                variants = {"default": None} if label == "baseline" else chosen
                for name, shape in variants.items():
                    _run(server, materialise(WorkloadSpec(num_requests=2, prompt_len=128, cap=8)), shape)  # warm-up
                    key = f"{label}: {name}"
                    r = _run(server, workload, shape)
                    runs.setdefault(key, []).append(r)
                    sys.stdout.write(f"repeat {rep}  {key:34s} {r['tok_s']:8.1f} tok/s  errors {r['errors']}\n")
                    sys.stdout.flush()
            finally:
                server.stop()
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    ref = med["current: default"]
    sys.stdout.write("\nmedians (output tok/s):\n")
    for k, v in med.items():
        sys.stdout.write(f"  {k:34s} {v:8.1f}  {100 * v / ref:6.1f} % of current default\n")
    if "baseline: default" in med:
        sys.stdout.write(f"  current default / baseline default: {100 * ref / med['baseline: default']:.1f} %\n")
    out.write_text(json.dumps({"args": vars(a), "runs": runs, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
