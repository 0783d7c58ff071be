"""`hyla sim`: a trace-driven simulator of the hybrid prefix cache at real model sizes.

It replays a request trace through hyla's own ``RadixCache`` and pools in accounting mode
(no tensors), so what it measures is what the engine's cache does:

* ``trace``      — the JSON Lines trace format (Marconi's, plus message boundaries);
* ``sharegpt``   — the ShareGPT trace set of Marconi's protocol, built offline;
* ``models``     — per-model KV / checkpoint bytes and FLOP model (presets or any config.json);
* ``latency``    — the modelled time to first token;
* ``policies``   — admission + eviction: ``block``, ``lru``, ``marconi``, ``hyla``;
* ``simulator``  — the replay loop and its metrics;
* ``sweep`` / ``plot`` / ``cli`` — many configurations on worker processes, the PNG, the command.

See ``docs/simulator.md``.
"""
