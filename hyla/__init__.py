"""hyla: a serving engine for hybrid LLMs with an exact hybrid prefix cache.

    from hyla import Engine

``Engine`` is imported lazily, so ``hyla sim`` (which needs only ``hyla.cache`` and the model
config parser) never pays for the engine's imports.
"""

__version__ = "0.1.0"
__all__ = ["Engine", "EngineArgs", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from hyla.engine.engine import Engine
        return Engine
    if name == "EngineArgs":
        from hyla.engine.args import EngineArgs
        return EngineArgs
    if name == "SamplingParams":
        from hyla.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'hyla' has no attribute {name!r}")
