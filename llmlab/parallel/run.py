"""Command line: greedy generation with tensor parallelism, text and per-rank memory.

    torchrun --nproc-per-node 3 -m llmlab.parallel.run --prompt "What is the capital of France?"
    python -m llmlab.parallel.run --tp 3 --prompt "..."        # same, ranks spawned by launch()

Every rank loads only its shard and runs the same loop; rank 0 prints. Taught in notebook 07.
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PROMPT = "What is the capital of France?"


def generate_and_report(model_name: str, prompt: str, max_new_tokens: int, device: str,
                        dtype: str, attention: str) -> tuple:
    """Run on every rank: (TPRun, decoded text); rank 0 is the one that prints."""
    import llmlab
    from llmlab.generate import encode_prompts

    from .workers import generate_on_ranks

    tok = llmlab.load_tokenizer(model_name)
    ids = encode_prompts(tok, [prompt], chat=True)[0]
    eos = llmlab.ModelConfig.from_file(llmlab.models.resolve(model_name)).eos_token_id
    run = generate_on_ranks(model_name, ids, max_new_tokens, attention, dtype, eos_token_id=eos)
    text = tok.decode([t for t in run.tokens if t != eos], skip_special_tokens=True)
    return run, text


def _report(run, text: str, model_name: str) -> None:
    print(f"model {model_name}, tp={run.tp} on {run.device}")
    print(f"text: {text}")
    print(f"load {run.load_s:.2f} s, prefill {run.prefill_s * 1e3:.0f} ms, "
          f"{run.s_per_token * 1e3:.1f} ms/token (median decode step), {len(run.tokens)} tokens")
    print("rank  q heads  kv heads  params MiB  read from checkpoint MiB  peak MiB")
    for m in run.memory:
        print(f"{m.rank:4d}  {m.heads:7d}  {m.kv_heads:8d}  {m.param_bytes / 2**20:10.1f}  "
              f"{m.bytes_read / 2**20:24.1f}  {m.peak_bytes / 2**20:8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmlab.parallel.run", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--tp", type=int, default=None,
                    help="spawn this many ranks (without torchrun); default: torchrun's WORLD_SIZE or 1")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--attention", default="naive")
    args = ap.parse_args(argv)
    opts = (args.model, args.prompt, args.max_new_tokens, args.device, args.dtype, args.attention)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        from .group import destroy_process_group, init_process_group

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group(rank, world, device=args.device)
        try:
            run, text = generate_and_report(*opts)
            if rank == 0:
                _report(run, text, args.model)
        finally:
            destroy_process_group()
        return 0

    from llmlab.parallel import run as this  # by its module name: spawned ranks import it
    from llmlab.parallel.launch import launch

    run, text = launch(this.generate_and_report, args.tp or 1, *opts, device=args.device)
    _report(run, text, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
