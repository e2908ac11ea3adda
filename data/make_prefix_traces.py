"""Regenerate the shared-prefix traces in data/traces/ (deterministic: same seed, same files).

    .venv/bin/python data/make_prefix_traces.py     # writes three traces, prints their stats

* ``multiturn_chat``: chat sessions with SmolLM2's chat template. Every session starts
  with the same system prompt; turn 0 is the templated system + user message, arriving
  as a Poisson process; turn k > 0 is the text appended after turn k-1's answer (the end
  of the assistant turn, a new user message, the assistant header), and arrives
  ``arrival_s`` seconds (a think time) after that answer ends. The engine sends turn k as
  turn k-1's prompt + its answer + this text (``llmlab.engine.sessions``).
* ``multiturn_long``: the same kind of sessions, 40 of them (157 turns) with
  shorter answers, so that a TTFT percentile rests on many turns: the p90 of the 33 turns
  of ``multiturn_chat`` is its fourth-slowest turn, which one preemption can move.
* ``fewshot``: single requests whose prompts share one of three few-shot preambles (an
  instruction and worked examples), then a question of their own; Poisson arrivals.

Fields as in the other traces (``prompt_tokens``: the SmolLM2 tokenizer's count of
``prompt`` with no special tokens added; chat markup in the text is tokenized as the
template's special tokens), plus ``session`` and ``turn`` in the multi-turn trace.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "traces"

SYSTEM = ("You are a patient tutor for a small evening class on how things work. Answer in "
          "plain words, give one concrete example, and keep each answer short enough to read "
          "aloud in half a minute. If a question is unclear, say what you assumed.")

QUESTIONS = [
    "Why does bread rise in a warm kitchen?",
    "How does a bicycle stay upright when it moves?",
    "What makes a kettle whistle?",
    "Why do ships made of steel float?",
    "How does a fridge keep food cold?",
    "Why is the sea salty but rivers are not?",
    "How do bees find their way back to the hive?",
    "What does a fuse in a plug do?",
    "Why do leaves change colour in autumn?",
    "How does a lock with a key work inside?",
    "Why does a compass point north?",
    "How do noise-cancelling headphones work?",
]
FOLLOW_UPS = [
    "Can you say that again with a different example?",
    "What would happen if it were twice as big?",
    "Is there a simple experiment I could do at home to see this?",
    "Which part of that is the most common mistake people make?",
    "How would you explain it to a seven-year-old?",
    "Does the same idea show up anywhere else in daily life?",
    "What did people believe about this before it was understood?",
    "Could you give me the short version in one sentence?",
]

PREAMBLES = [
    ("Label the feeling of each sentence as positive, negative or neutral.",
     [("The soup was cold and the waiter ignored us.", "negative"),
      ("The train arrives at platform four at noon.", "neutral"),
      ("I finally finished the puzzle and it looks wonderful.", "positive"),
      ("Nobody came to the meeting I planned for weeks.", "negative"),
      ("The garden looks lovely after the rain.", "positive")],
     ["The new library opens on Monday.", "My phone fell in the lake again.",
      "We won the match in the last minute!", "The shop sells bread and milk.",
      "The film was far too long and boring.", "Our neighbours brought us a cake."]),
    ("Turn each sentence into a question that it answers.",
     [("The bridge was built in 1932.", "When was the bridge built?"),
      ("Maria plays the cello in an orchestra.", "What instrument does Maria play?"),
      ("The museum is closed on Tuesdays.", "On which day is the museum closed?"),
      ("Salmon swim upstream to lay their eggs.", "Why do salmon swim upstream?"),
      ("The bakery opens at six in the morning.", "When does the bakery open?")],
     ["The river floods every spring.", "Tom repaired the roof with new tiles.",
      "The comet returns every 76 years.", "Owls hunt mostly at night.",
      "The recipe needs three eggs.", "The school has four hundred pupils."]),
    ("Give the plural of each word.",
     [("child", "children"), ("mouse", "mice"), ("knife", "knives"),
      ("cactus", "cacti"), ("sheep", "sheep"), ("tooth", "teeth")],
     ["goose", "leaf", "city", "box", "woman", "potato", "foot", "wolf"]),
]


def chat_turn0(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def chat_next(user: str) -> str:
    return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def multiturn(tok, rng: random.Random, sessions: int = 8, rate: float = 0.6,
              answers: tuple[int, int] = (16, 40)) -> list[dict]:
    rows, t = [], 0.0
    for s in range(sessions):
        t += rng.expovariate(rate)
        turns = rng.choice([3, 4, 4, 5])
        question = QUESTIONS[s % len(QUESTIONS)]
        follow = rng.sample(FOLLOW_UPS, turns - 1)
        for k in range(turns):
            text = chat_turn0(question) if k == 0 else chat_next(follow[k - 1])
            rows.append({"id": f"chat-{s:02d}-t{k}", "session": f"chat-{s:02d}", "turn": k,
                         "arrival_s": round(t if k == 0 else rng.uniform(0.2, 1.5), 3),
                         "prompt": text,
                         "prompt_tokens": len(tok(text, add_special_tokens=False)["input_ids"]),
                         "output_tokens": rng.randint(*answers)})
    return rows


def fewshot(tok, rng: random.Random, n: int = 36, rate: float = 2.0) -> list[dict]:
    rows, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        instruction, examples, queries = PREAMBLES[rng.randrange(len(PREAMBLES))]
        shots = "".join(f"Input: {a}\nOutput: {b}\n\n" for a, b in examples)
        text = f"{instruction}\n\n{shots}Input: {rng.choice(queries)}\nOutput:"
        rows.append({"id": f"fewshot-{i:03d}", "arrival_s": round(t, 3), "prompt": text,
                     "prompt_tokens": len(tok(text, add_special_tokens=False)["input_ids"]),
                     "output_tokens": rng.randint(4, 16)})
    return rows


def main() -> int:
    sys.path.insert(0, str(HERE.parent))
    import llmlab

    tok = llmlab.load_tokenizer("smollm2-135m")
    for name, rows in (("multiturn_chat", multiturn(tok, random.Random(13))),
                       ("multiturn_long", multiturn(tok, random.Random(15), sessions=40,
                                                    answers=(8, 24))),
                       ("fewshot", fewshot(tok, random.Random(14)))):
        path = OUT / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sessions = len({r.get("session", r["id"]) for r in rows})
        print(f"{name}: {len(rows)} requests in {sessions} sessions, prompt text "
              f"{sum(r['prompt_tokens'] for r in rows)} tokens, outputs "
              f"{sum(r['output_tokens'] for r in rows)} tokens -> {path.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
