"""`hyla bench`: an async serving benchmark client (OpenAI-compatible or hyla's native API).

``datasets`` builds workloads (ShareGPT multi-turn sessions, random prompts with shared prefixes),
``backends`` sends one streaming request and times it, ``runner`` schedules sessions (Poisson rate
or concurrency cap), ``metrics`` turns the results into throughput / TTFT / TPOT / ITL / cache-hit
numbers. See ``docs/bench.md``.
"""
