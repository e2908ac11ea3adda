"""Figures for notebook 00: the next-token distribution under temperature and top-k/top-p."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from ..sampling import filter_logits


@torch.inference_mode()
def next_token_distribution(model, tokenizer, prompt: str, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None,
                            show: int = 12, chat: bool = True):
    """Bar chart of the model's next-token probabilities after ``prompt``.

    Returns (figure, [(token text, probability), ...]) for the ``show`` most likely tokens.
    ``temperature=0`` shows greedy: all mass on the argmax.
    """
    from ..prompts import encode_prompts

    ids = torch.tensor(encode_prompts(tokenizer, [prompt], chat), device=model.device)
    logits = model(ids, last_only=True)[0, -1].float()
    if temperature == 0:
        probs = torch.zeros_like(logits)
        probs[logits.argmax()] = 1.0
    else:
        probs = torch.softmax(filter_logits((logits / temperature)[None], top_k, top_p)[0], -1)
    p, idx = torch.topk(probs, show)
    labels = [repr(tokenizer.decode([int(i)])) for i in idx]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    ax.barh(range(show)[::-1], p.tolist(), color="tab:blue")
    ax.set_yticks(range(show)[::-1], labels)
    ax.set_xlabel("probability of the next token")
    ax.set_xlim(0, 1)
    ax.set_title(f"temperature={temperature}, top_k={top_k}, top_p={top_p}")
    fig.tight_layout()
    return fig, list(zip(labels, p.tolist()))
