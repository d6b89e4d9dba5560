"""The CPU fast path: packed projections, fused Llama blocks, the lean
decoder forward, GGUF weight blocks kept packed, and huge-page placement.

Everything here is an optimisation of the transformers forward the runner
falls back to; docs/native.md says what each piece buys.
"""
