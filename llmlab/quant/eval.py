"""How much did quantization change the model? Measured against the float32 model.

llama.cpp reports its quantization types the same way (its ``perplexity`` tool with
``--kl-divergence``): over a fixed text, at every position,

* the KL divergence KL(P_fp32 ‖ P_quant) of the next-token distributions, in nats per token;
* top-1 agreement: how often both models rank the same token first;
* perplexity of each model on the text;

and, on chat prompts, how many greedy tokens the quantized model generates before it
first departs from the float32 model's answer.

The text is ``data/text/memory_hierarchy.md`` (written for this workbook, Apache-2.0,
about 2,500 tokens). Taught in notebook 08.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EVAL_TEXT = Path(__file__).resolve().parents[2] / "data" / "text" / "memory_hierarchy.md"
CHAT_PROMPTS = ("What is the capital of France?",
                "Give me three tips for sleeping better.",
                "Explain what a CPU cache is in two sentences.",
                "Write a haiku about autumn leaves.")


def eval_text() -> str:
    """The evaluation text (its first lines are a title and a licence note)."""
    return EVAL_TEXT.read_text()


def eval_token_ids(tokenizer, max_tokens: int | None = None) -> list[int]:
    """Token ids of the evaluation text, optionally only the first ``max_tokens``."""
    ids = tokenizer(eval_text())["input_ids"]
    return ids if max_tokens is None else ids[:max_tokens]


@dataclass
class Quality:
    """One model against the float32 reference over ``tokens`` predicted positions."""
    tokens: int
    kld: float              # mean KL(P_ref ‖ P_model), nats per token
    kld_p99: float          # 99th percentile of the per-token KLD
    top1: float             # fraction of positions where both argmaxes agree
    ppl: float              # perplexity of this model on the text
    ppl_ref: float          # perplexity of the reference

    @property
    def ppl_delta(self) -> float:
        return self.ppl - self.ppl_ref


@torch.inference_mode()
def compare_logits(reference, models: dict, token_ids: list[int], window: int = 512
                   ) -> dict[str, Quality]:
    """Run ``reference`` and each of ``models`` over ``token_ids`` in windows of ``window``
    tokens (each window a fresh context, so the cost stays linear) and compare the
    next-token distributions at every position. -> {name: :class:`Quality`}."""
    if window < 2:
        raise ValueError(f"window={window} must be >= 2")
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens; got {len(token_ids)}")
    klds = {name: [] for name in models}
    agree = {name: 0 for name in models}
    nll = {name: 0.0 for name in models}
    nll_ref, count = 0.0, 0
    ids = torch.tensor(token_ids, dtype=torch.long)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        x, target = chunk[:-1][None].to(reference.device), chunk[1:].to(reference.device)
        ref_lp = F.log_softmax(reference(x)[0].float(), dim=-1)
        nll_ref += -ref_lp.gather(1, target[:, None]).sum().item()
        ref_top = ref_lp.argmax(-1)
        for name, model in models.items():
            lp = F.log_softmax(model(x)[0].float(), dim=-1)
            klds[name].append((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0))
            agree[name] += (lp.argmax(-1) == ref_top).sum().item()
            nll[name] += -lp.gather(1, target[:, None]).sum().item()
        count += len(target)
    out = {}
    for name in models:
        k = torch.cat(klds[name])
        out[name] = Quality(tokens=count, kld=k.mean().item(),
                            kld_p99=torch.quantile(k, 0.99).item(), top1=agree[name] / count,
                            ppl=math.exp(nll[name] / count), ppl_ref=math.exp(nll_ref / count))
    return out


@dataclass
class GreedyAgreement:
    """Greedy answers to chat prompts, against the reference's."""
    matched: list[int]      # per prompt: tokens equal to the reference's before the first difference
    lengths: list[int]      # per prompt: tokens the reference generated

    @property
    def fraction(self) -> float:
        """Share of the reference's tokens reproduced before the first difference."""
        return sum(self.matched) / max(1, sum(self.lengths))

    @property
    def identical(self) -> int:
        return sum(m == n for m, n in zip(self.matched, self.lengths))


def _prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_answers(model, tokenizer, prompts=CHAT_PROMPTS, max_new_tokens: int = 32
                   ) -> list[list[int]]:
    """Greedy token ids of ``model``'s answer to each chat prompt."""
    from ..generate import generate

    outs = generate(model, tokenizer, list(prompts), max_new_tokens=max_new_tokens,
                    kv_cache="contiguous", chat=True)
    return [o.token_ids for o in outs]


def greedy_agreement(reference_answers: list[list[int]], answers: list[list[int]]
                     ) -> GreedyAgreement:
    """Compare greedy answers (from :func:`greedy_answers`) position by position."""
    if len(reference_answers) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(reference_answers)} reference answers")
    return GreedyAgreement(matched=[_prefix_match(r, a) for r, a in zip(reference_answers, answers)],
                           lengths=[len(r) for r in reference_answers])


def evaluate(reference, models: dict, tokenizer, max_tokens: int | None = None,
             window: int = 512, greedy_tokens: int = 32) -> list[dict]:
    """The full report as rows: per model KLD, top-1, perplexity and greedy agreement."""
    ids = eval_token_ids(tokenizer, max_tokens)
    quality = compare_logits(reference, models, ids, window)
    ref_answers = greedy_answers(reference, tokenizer, max_new_tokens=greedy_tokens)
    rows = []
    for name, model in models.items():
        q = quality[name]
        g = greedy_agreement(ref_answers, greedy_answers(model, tokenizer,
                                                         max_new_tokens=greedy_tokens))
        rows.append({"scheme": name, "tokens": q.tokens, "KLD nats/tok": q.kld,
                     "KLD p99": q.kld_p99, "top-1 agree": q.top1, "ppl": q.ppl,
                     "ppl fp32": q.ppl_ref, "greedy agree": g.fraction,
                     "identical answers": f"{g.identical}/{len(g.lengths)}"})
    return rows


def group_format_bytes(config, bits: int, group_size: int | None, head_bytes: float = 34 / 32
                      ) -> float:
    """Modelled weight bytes of a model whose decoder linears use ``bits``-bit codes with a
    float16 step and minimum per ``group_size`` inputs (None: one pair per output row),
    the tied embedding/lm_head at ``head_bytes`` per weight (default: Q8_0, an int8 code
    plus a float16 scale per 32) and float32 norms."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    per_layer = 0.0
    for out_f, in_f in shapes:
        groups = out_f * (1 if group_size is None else in_f // group_size)
        per_layer += out_f * in_f * bits / 8 + groups * 4
    norms = (2 * config.num_layers + 1) * h * 4
    return config.num_layers * per_layer + config.vocab_size * h * head_bytes + norms


@torch.inference_mode()
def sweep_bits_group(reference, token_ids: list[int], bits_list=(2, 3, 4, 8),
                     groups=(16, 32, 64, None)) -> dict:
    """KLD and top-1 agreement against ``reference`` for every (bits, group size), with
    the group-wise asymmetric format simulated on the decoder linears (None: one group
    per row), over one window of ``token_ids``.
    -> {(bits, group): {"kld", "top1", "bytes"}} (bytes modelled, lm_head Q8_0)."""
    from . import fake_quantize
    from .formats import group_dequantize, group_quantize

    x = torch.tensor([token_ids[:-1]], device=reference.device)
    ref_lp = F.log_softmax(reference(x)[0].float(), dim=-1)
    out = {}
    for bits in bits_list:
        for g in groups:
            def roundtrip(w, bits=bits, g=g):
                return group_dequantize(*group_quantize(w, bits, w.shape[1] if g is None else g))
            lp = F.log_softmax(fake_quantize(reference, roundtrip)(x)[0].float(), dim=-1)
            out[(bits, g)] = {"kld": (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).mean().item(),
                              "top1": (lp.argmax(-1) == ref_lp.argmax(-1)).float().mean().item(),
                              "bytes": group_format_bytes(reference.config, bits, g)}
    return out
