"""cbserve benchmark suite: load generator, peer runners, roofline and reports.

Entry points: ``python -m bench ...`` or ``cbserve bench ...`` (both end up in
``bench.cli.main``). See docs/benchmarks.md and docs/benchmarks-method.md.
"""
