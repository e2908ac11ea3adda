"""Regenerate the request traces in data/traces/ (deterministic: same seed, same files).

    .venv/bin/python data/make_trace.py          # writes data/traces/*.jsonl, prints stats

Each line of a trace is one request::

    {"id": "sharegpt-0007", "arrival_s": 3.512, "prompt": "...", "prompt_tokens": 143,
     "output_tokens": 296}

``prompt_tokens`` is the exact count of the SmolLM2 tokenizer on ``prompt`` (no chat
template, no special tokens); ``output_tokens`` is how many tokens the request generates
(serving benchmarks run with ``ignore_eos`` so each request produces exactly that many).
Arrivals are a Poisson process: exponential gaps with mean 1 / rate.

Length distributions (log-normal, truncated to a range, with the location fitted so the
*truncated* mean equals the target):

* ``sharegpt_like``: mean input 161.31 and mean output 337.99 tokens, the ShareGPT
  statistics in the vLLM paper (Kwon et al., "Efficient Memory Management for Large
  Language Model Serving with PagedAttention", SOSP 2023, §6.1: ShareGPT has 8.4× longer
  inputs and 5.8× longer outputs than Alpaca). Inputs in [4, 1024], outputs in [4, 1024].
* ``alpaca_like``: mean input 19.31 and mean output 58.45 tokens (same paper, Alpaca).
  Inputs in [4, 256], outputs in [4, 512].
* ``cpu``: a small trace a 135M model on a laptop CPU serves in minutes: 80 requests,
  inputs in [16, 256] (mean 64), outputs in [8, 128] (mean 40).

The log-normal shape and its spread (sigma) are our choice; the paper publishes only
histograms and means. Prompts are real English text: sentences from the small corpus
below, drawn at random and trimmed word by word to the sampled token count (the
tokenizer decides; a prompt lands within a couple of tokens of its target).
"""
from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "traces"

OPENERS = [
    "Please summarize the following notes in a few sentences.",
    "Read the text below and answer the question at the end.",
    "Rewrite this passage so that a twelve-year-old could follow it.",
    "Give three key points from these notes.",
    "Explain the main idea of the following text.",
    "Translate the tone of this passage into a friendly email.",
    "Continue the story below for a few more paragraphs.",
    "List the facts in the text that could be checked.",
]

SENTENCES = [
    "The river rose quickly after three days of steady rain in the hills.",
    "Farmers along the valley moved their cattle to higher ground before dawn.",
    "A small bakery on the corner sells bread that is still warm at seven.",
    "The committee met on Tuesday to discuss the budget for the new library.",
    "Most of the old railway line has been turned into a path for cyclists.",
    "Bees visit thousands of flowers to gather enough nectar for a spoon of honey.",
    "The museum keeps its oldest maps in a cool room with dim light.",
    "Engineers tested the bridge by driving heavy trucks across it at night.",
    "Her grandmother kept a notebook of recipes written in pencil.",
    "The telescope on the mountain can see galaxies billions of light years away.",
    "A good night of sleep helps the brain store what it learned during the day.",
    "The team rewrote the slow function and the report now loads in one second.",
    "Children in the village walk two miles to reach the nearest school.",
    "Salt was once so valuable that soldiers were sometimes paid with it.",
    "The ship carried tea, silk and porcelain across the ocean in four months.",
    "Wind turbines on the coast supply power to about ten thousand homes.",
    "The recipe asks for two cups of flour, one egg and a pinch of salt.",
    "Volunteers planted five hundred trees along the edge of the park.",
    "A compiler turns source code into instructions a processor can run.",
    "The orchestra rehearsed the symphony for six weeks before the concert.",
    "Heavy snow closed the mountain pass for most of January.",
    "The lighthouse keeper wrote the weather in a log every evening.",
    "Many desert plants store water in thick leaves or swollen stems.",
    "The startup grew from three people in a garage to two hundred staff.",
    "Our cat sleeps on the warm windowsill every afternoon.",
    "The printing press made books cheap enough for ordinary families.",
    "Doctors recommend washing hands with soap for at least twenty seconds.",
    "The bus to the airport leaves every half hour from the main square.",
    "Glaciers carve wide valleys as they slide slowly downhill.",
    "The new policy lets employees work from home two days a week.",
    "A language model predicts the next word from the words that came before.",
    "The market opens early and the best fruit is gone by nine.",
    "Copper wires carry electricity from the station to the town.",
    "The author spent ten years researching the history of the canal.",
    "Octopuses can change the colour of their skin in less than a second.",
    "The students built a small robot that follows a line on the floor.",
    "Prices of fresh vegetables rose after the long dry summer.",
    "The castle walls are three metres thick at the base.",
    "Migrating birds use the sun, the stars and the earth's magnetic field to navigate.",
    "The software update fixed a bug that made the app crash on startup.",
    "Rainforests cover a small part of the land but hold most of its species.",
    "The chef tasted the soup and added a little more pepper.",
    "Trains in the city run every five minutes during rush hour.",
    "The old clock in the tower has not stopped once in a hundred years.",
    "Scientists measured the temperature of the lake at different depths.",
    "The library lends tools, seeds and musical instruments as well as books.",
    "A fever is the body's way of making life harder for invading germs.",
    "The runners started before sunrise to avoid the heat of the day.",
    "Memory on a graphics card is fast but much smaller than main memory.",
    "The village holds a festival every autumn when the apples are ripe.",
    "Good documentation saves hours for the next person who reads the code.",
    "The painter mixed blue and yellow to get the green of the hills.",
    "Fishing boats return to the harbour in the late afternoon.",
    "The council voted to repair the roads before building anything new.",
    "Sound travels faster through water than through air.",
    "The garden was full of tomatoes, beans and tall sunflowers.",
    "The pilot announced that the flight would land twenty minutes early.",
    "Caching saves work by keeping results that will be needed again.",
    "The hikers reached the summit just as the clouds cleared.",
    "What would change if the same idea were tried in a much larger city?",
    "Which of these events do you think mattered most, and why?",
    "How could the same problem be solved with half the money?",
]


@dataclass(frozen=True)
class Spec:
    name: str
    num_requests: int
    rate_per_s: float            # Poisson arrival rate
    input_mean: float
    input_range: tuple[int, int]
    input_sigma: float
    output_mean: float
    output_range: tuple[int, int]
    output_sigma: float
    seed: int


SPECS = [
    Spec("sharegpt_like", 300, 1.0, 161.31, (4, 1024), 0.9, 337.99, (4, 1024), 0.9, 2023),
    Spec("alpaca_like", 300, 8.0, 19.31, (4, 256), 0.6, 58.45, (4, 512), 0.8, 2024),
    Spec("cpu", 80, 2.0, 64.0, (16, 256), 0.7, 40.0, (8, 128), 0.7, 7),
]


def _truncated_mean(mu: float, sigma: float, lo: int, hi: int, n: int = 20000) -> float:
    rng = random.Random(0)
    xs = [_draw(rng, mu, sigma, lo, hi) for _ in range(n)]
    return sum(xs) / n


def _draw(rng: random.Random, mu: float, sigma: float, lo: int, hi: int) -> int:
    while True:                                   # resample outside [lo, hi]
        x = round(math.exp(rng.gauss(mu, sigma)))
        if lo <= x <= hi:
            return x


def fit_mu(mean: float, sigma: float, lo: int, hi: int) -> float:
    """Location of a log-normal whose [lo, hi]-truncated mean is ``mean`` (bisection)."""
    a, b = math.log(lo) - 3, math.log(hi) + 3
    for _ in range(40):
        mid = (a + b) / 2
        if _truncated_mean(mid, sigma, lo, hi) < mean:
            a = mid
        else:
            b = mid
    return (a + b) / 2


class PromptWriter:
    """Real-text prompts of a requested token count (SmolLM2 tokenizer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def count(self, text: str) -> int:
        return len(self.tok(text)["input_ids"])

    def write(self, rng: random.Random, target: int) -> str:
        words = rng.choice(OPENERS).split()
        approx = self.count(" ".join(words))
        while approx < target + 4:                # overshoot, then trim
            s = rng.choice(SENTENCES)
            words += s.split()
            approx += self.count(" " + s)
        lo, hi = 1, len(words)                    # fewest words reaching the target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(" ".join(words[:mid])) >= target:
                hi = mid
            else:
                lo = mid + 1
        return " ".join(words[:lo])


def make(spec: Spec, writer: PromptWriter) -> list[dict]:
    rng = random.Random(spec.seed)
    mu_in = fit_mu(spec.input_mean, spec.input_sigma, *spec.input_range)
    mu_out = fit_mu(spec.output_mean, spec.output_sigma, *spec.output_range)
    t, rows = 0.0, []
    for i in range(spec.num_requests):
        t += rng.expovariate(spec.rate_per_s)
        target = _draw(rng, mu_in, spec.input_sigma, *spec.input_range)
        out = _draw(rng, mu_out, spec.output_sigma, *spec.output_range)
        prompt = writer.write(rng, target)
        rows.append({"id": f"{spec.name}-{i:04d}", "arrival_s": round(t, 3), "prompt": prompt,
                     "prompt_tokens": writer.count(prompt), "output_tokens": out,
                     "target_prompt_tokens": target})
    return rows


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE.parent))
    import llmlab

    writer = PromptWriter(llmlab.load_tokenizer("smollm2-135m"))
    OUT.mkdir(exist_ok=True)
    for spec in SPECS:
        rows = make(spec, writer)
        path = OUT / f"{spec.name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = len(rows)
        mean_in = sum(r["prompt_tokens"] for r in rows) / n
        mean_out = sum(r["output_tokens"] for r in rows) / n
        off = max(abs(r["prompt_tokens"] - r["target_prompt_tokens"]) for r in rows)
        print(f"{path.relative_to(HERE.parent)}: {n} requests, mean input {mean_in:.1f} "
              f"(target {spec.input_mean}), mean output {mean_out:.1f} (target "
              f"{spec.output_mean}), max |prompt - target| {off} tokens, "
              f"last arrival {rows[-1]['arrival_s']:.1f} s, {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
