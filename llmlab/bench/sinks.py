"""python -m llmlab.bench sinks: SmolLM2's perplexity over a long text of the workbook's own,
with a full cache, a sliding window alone, and the window plus attention sinks (StreamingLLM).

    python -m llmlab.bench sinks [--tokens 1024] [--windows 32 64 128 256] [--sinks 0 1 4 8]
                                 [--chunk 128] [--out data/long_context/sinks_sweep.json] [--gpu]

The text is ``data/text/calibration_prose.md`` followed by ``data/text/memory_hierarchy.md``
(both written for this workbook). Every configuration is scored on the same predictions:
those after the largest ``sinks + window`` of the sweep, where every windowed cache has
started to evict. Prints the table and writes the sweep (perplexities and the loss along
the text in bins) that notebook 14's widget reads (with ``--gpu``: on CUDA in bfloat16, to
``$LLMLAB_RESULTS`` and not over the committed CPU sweep unless ``--out`` says so). A
measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TEXTS = (ROOT / "data" / "text" / "calibration_prose.md",
         ROOT / "data" / "text" / "memory_hierarchy.md")
SWEEP_FILE = ROOT / "data" / "long_context" / "sinks_sweep.json"
BIN = 32          # tokens per bin of the loss-along-the-text curve


def long_text_ids(tokenizer, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` token ids of the workbook's two prose texts, joined."""
    text = "\n\n".join(p.read_text() for p in TEXTS)
    ids = tokenizer(text)["input_ids"]
    if max_tokens > len(ids):
        raise ValueError(f"max_tokens={max_tokens} is more than the texts' {len(ids)} tokens")
    return ids[:max_tokens]


def binned(nll: torch.Tensor, size: int = BIN) -> list[float]:
    """Mean loss per bin of ``size`` predictions (the last bin may be shorter)."""
    return [round(float(nll[i:i + size].mean()), 4) for i in range(0, nll.numel(), size)]


def measure(model, ids, sinks: int, window: int | None, chunk: int, skip: int) -> dict:
    """One configuration: perplexity over the predictions after ``skip``, its loss binned
    along the text, and the seconds it took."""
    from ..cache.sinks import streaming_nll

    t0 = time.perf_counter()
    nll = streaming_nll(model, ids, sinks, window, chunk)
    seconds = time.perf_counter() - t0
    return {"sinks": sinks, "window": window, "ppl": round(float(torch.exp(nll[skip:].mean())), 4),
            "nll_bins": binned(nll), "seconds": round(seconds, 2)}


def sweep(model, ids, windows, sinks_list, chunk: int = 128) -> dict:
    """Full cache, then every (window, sinks) of the grid; scored after the largest cache."""
    skip = max(windows) + max(sinks_list)
    if skip >= len(ids) - 1:
        raise ValueError(f"{len(ids)} tokens leave nothing to score after the largest cache "
                         f"({skip} tokens); use a longer text or smaller windows")
    rows = [measure(model, ids, 0, None, chunk, skip)]
    for window in windows:
        for sinks in sinks_list:
            rows.append(measure(model, ids, sinks, window, chunk, skip))
    return {"tokens": len(ids), "skip": skip, "bin": BIN, "chunk": chunk, "rows": rows}


def save(result: dict, path: Path = SWEEP_FILE, device: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"what": "SmolLM2-135M perplexity through llmlab.cache.sinks.SinkKVCache",
            "command": "python -m llmlab.bench sinks", "device": device,
            "date": time.strftime("%Y-%m-%d"), "texts": [p.name for p in TEXTS]}
    path.write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")


def load_sweep(path: Path = SWEEP_FILE) -> dict:
    """The committed sweep (see :func:`save`); FileNotFoundError names the command."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing; run `python -m llmlab.bench sinks`")
    return json.loads(Path(path).read_text())


def table(result: dict) -> str:
    full = result["rows"][0]["ppl"]
    lines = [f"{'cache':24s} {'ppl':>8s} {'vs full':>8s} {'seconds':>8s}"]
    for r in result["rows"]:
        name = "full" if r["window"] is None else f"window {r['window']} + {r['sinks']} sinks"
        lines.append(f"{name:24s} {r['ppl']:8.2f} {r['ppl'] / full:7.2f}x {r['seconds']:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import llmlab
    from ..device import describe

    p = argparse.ArgumentParser(prog="python -m llmlab.bench sinks",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--windows", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", type=Path, default=None,
                   help=f"where to write the sweep (default {SWEEP_FILE.relative_to(ROOT)} on "
                        "the CPU; nowhere but $LLMLAB_RESULTS with --gpu)")
    p.add_argument("--gpu", action="store_true", help="run on CUDA (needs a GPU)")
    args = p.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("sinks --gpu needs CUDA; nothing to do on this machine")
        return 0
    for name, values, low in (("--windows", args.windows, 1), ("--sinks", args.sinks, 0),
                              ("--chunk", [args.chunk], 1), ("--tokens", [args.tokens], 2)):
        if any(v < low for v in values):
            raise ValueError(f"{name} {values}: each must be >= {low}")
    device = "cuda" if args.gpu else "cpu"
    model = llmlab.load_model("smollm2-135m", attention="sdpa", device=device)
    tok = llmlab.load_tokenizer("smollm2-135m")
    ids = long_text_ids(tok, args.tokens)
    device = describe().get("device", "") if not args.gpu else torch.cuda.get_device_name()
    print(f"device: {device}, {model.dtype}, torch threads {torch.get_num_threads()}; "
          f"{len(ids)} tokens")
    result = sweep(model, ids, args.windows, args.sinks, args.chunk)
    print(f"perplexity over predictions {result['skip']}..{len(ids) - 1} "
          f"(after the largest cache of the sweep)")
    print(table(result))
    from ._common import save as save_results

    save_results("sinks", result)
    out = args.out if args.out is not None else (None if args.gpu else SWEEP_FILE)
    if out is not None:
        save(result, out, device)
        print(f"-> {out}")
    return 0
