"""The `cbserve` command.

cbserve serve      router + executor on this machine (the embedded default)
cbserve router     the router alone
cbserve executor   the executor alone
cbserve generate   a streaming client for the terminal
cbserve health     grpc.health.v1 probe (exit 0 when SERVING)
cbserve bench      load generator and reports
"""

from __future__ import annotations

import argparse
import os
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded SmolLM2-135M-Instruct), 'tiny', or a local HF checkpoint dir",
    )
    p.add_argument("--config", default=None, help="router YAML config (see deploy/base/router.yaml)")
    p.add_argument("--port", type=int, default=None, help="public gRPC port (default 50051)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default 9090; 0 = off)")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (default 8000; 0 = off)")
    p.add_argument("--host", default=None, help="listen address (default 0.0.0.0)")
    p.add_argument("--executor-address", default=None, help="unix:///path or host:port of the executor")
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        "(the config's speculative section; docs/speculative.md)",
    )
    # LoRA (the config's lora section; docs/lora.md), with vLLM's flag names.
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    p.add_argument(
        "--lora-modules",
        "--lora",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) requests choose by `model`; repeatable",
    )
    p.add_argument("--max-loras", type=int, default=None, help="adapters one step can run with (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 64)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept read in memory (default max-loras)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbserve", description="LLM serving with continuous batching")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="start executor and router on this machine")
    _common(serve)
    serve.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32 | float16")
    serve.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="int8: the executor serves a checkpoint's projections as int8 weights (per-channel scales; CPU, bf16)",
    )
    serve.add_argument(
        "--device",
        default="auto",
        help="executor device: auto (the first CUDA GPU if torch sees one, else cpu) | cpu | cuda | cuda:N",
    )
    serve.add_argument("--attention-backend", default="native", choices=["native", "torch"])
    serve.add_argument(
        "--executor-threads", type=int, default=0, help="torch threads of the executor (0 = one per core)"
    )
    serve.add_argument(
        "--max-model-len", type=int, default=0, help="longest sequence served, prompt + output (0 = the model's)"
    )
    serve.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=256,
        help="executor on a CUDA GPU: decode steps of up to this many sequences replay CUDA graphs (0 = eager)",
    )
    serve.add_argument(
        "--executor-metrics-port", type=int, default=0, help="Prometheus port of the executor process (0 = off)"
    )
    serve.add_argument("--executor-metrics-host", default="127.0.0.1", help="address the executor's metrics port binds")
    router = sub.add_parser("router", help="start the router alone")
    _common(router)
    sub.add_parser("executor", help="start the executor alone (see cbserve executor --help)", add_help=False)
    sub.add_parser("generate", help="stream a completion to the terminal", add_help=False)
    sub.add_parser("bench", help="load generator and reports", add_help=False)
    health = sub.add_parser("health", help="gRPC health probe")
    health.add_argument("--address", default="127.0.0.1:50051")
    health.add_argument("--service", default="")
    health.add_argument("--timeout", type=float, default=4.0)
    return parser


def _exec_module(module: str, argv: list[str]) -> int:
    """Runs another package's entry point in this process image (the router
    package does not import the executor or the benchmarks)."""
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "executor":
        return _exec_module("executor", argv[1:])
    if argv and argv[0] == "bench":
        return _exec_module("bench", argv[1:])
    if argv and argv[0] == "generate":
        from router.client_cli import main as generate_main

        return generate_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd == "health":
        from router.client_cli import health_main

        return health_main(args.address, args.service, args.timeout)
    from router.config import ConfigError
    from router.tokenizer import TokenizerUnavailable

    try:
        if args.cmd == "serve":
            from router.supervisor import serve_main

            return serve_main(args)
        from router.main import router_main

        return router_main(args)
    except ConfigError as exc:
        print(f"cbserve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (OSError, TokenizerUnavailable) as exc:  # a port in use, a certificate or tokenizer that cannot be read
        print(f"cbserve: cannot start: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
