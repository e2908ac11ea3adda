"""The exercises of notebook 13 (KV beyond one request: a radix prefix cache, split-KV decode,
attention sinks).

Radix prefix cache:

- ``nb13.radix_match_insert`` (build): the radix tree's ``match`` and ``insert``, run by the
  engine on the multi-turn trace.

Long contexts (split-KV decode, attention sinks): see the section below.
"""
from __future__ import annotations

from . import Verdict, choice_verdict, exercise, forbid, right, wrong  # noqa: F401

NB = "13_kv_beyond_one_request"

# ---- radix prefix cache ----------------------------------------------------------------------


# ---- long contexts: split-KV decode and attention sinks --------------------------------------
