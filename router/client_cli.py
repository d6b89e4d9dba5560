"""`cbserve generate` and `cbserve health`: small gRPC clients for people and
probes (they import only grpc and the generated stubs)."""

from __future__ import annotations

import argparse
import sys

import grpc


def _channel(address: str, tls_ca: str | None = None):
    if tls_ca:
        with open(tls_ca, "rb") as fh:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(fh.read()))
    return grpc.insecure_channel(address)


def main(argv: list[str]) -> int:
    from cbserve.v1 import generation_pb2 as gpb
    from cbserve.v1 import generation_pb2_grpc as gpb_grpc

    p = argparse.ArgumentParser(prog="cbserve generate", description="Stream a completion to the terminal.")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="send as a user chat message (chat template)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--token", default=None, help="bearer token, when the server requires one")
    p.add_argument("--tls-ca", default=None, help="CA certificate to verify a TLS server")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--model", default="", help="which of the router's models (default: the first)")
    args = p.parse_args(argv)

    req = gpb.GenerateRequest(
        sampling=gpb.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
        stopping=gpb.StoppingCriteria(max_new_tokens=args.max_new_tokens, stop=args.stop),
        priority=args.priority,
        model=args.model,
    )
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.chat:
        req.messages.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    with _channel(args.address, args.tls_ca) as channel:
        stub = gpb_grpc.GenerationStub(channel)
        try:
            last = None
            for resp in stub.Generate(req, metadata=metadata, timeout=args.timeout):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
            sys.stdout.write("\n")
            if last is not None:
                reason = gpb.FinishReason.Name(last.finish_reason)
                sys.stderr.write(
                    f"[{reason}; prompt {last.usage.prompt_tokens} tokens, "
                    f"completion {last.usage.completion_tokens} tokens]\n"
                )
        except grpc.RpcError as exc:
            sys.stderr.write(f"\nerror: {exc.code().name}: {exc.details()}\n")
            return 1
    return 0


def health_main(address: str, service: str = "", timeout: float = 4.0) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as exc:
        sys.stderr.write(f"{address}: {exc.code().name}\n")
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    sys.stdout.write(f"{address}: {status}\n")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
