"""flexpipe: serve LLMs on the GPUs a cluster actually has free."""

__version__ = "0.1.0"
