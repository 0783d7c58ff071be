"""hyla: a serving engine for hybrid LLMs with an exact hybrid prefix cache."""

__version__ = "0.1.0"
