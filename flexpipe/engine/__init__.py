"""The sim engine: a vLLM-compatible server whose timing is the performance model."""
