"""What the router and the executor processes both need, and nothing else.

Layering: `common` imports neither `router`, `executor` nor `native`; both
processes may import it (docs/architecture.md, "Layering").
"""
