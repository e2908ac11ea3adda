"""Benchmarks behind ``python -m llmlab.bench <name>``; shared helpers in ``_common``."""
