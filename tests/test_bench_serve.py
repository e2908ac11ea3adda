"""The serve benchmark's bookkeeping: the token positions each system computes, which the
bench divides to split a speedup into work saved and time per position."""
import dataclasses

import pytest

from llmlab.bench.serve import parse_args, run_hf, run_llmlab
from llmlab.engine import LLM
from llmlab.traces import TRACES_DIR, load_trace


@pytest.mark.slow
def test_hf_positions_match_static_batching(smollm2, tokenizer, hf_smollm2):
    trace = load_trace(TRACES_DIR / "cpu.jsonl", 3, tokenizer=tokenizer)
    trace = [dataclasses.replace(r, output_tokens=n) for r, n in zip(trace, (3, 6, 2))]
    hf = run_hf(hf_smollm2, tokenizer, trace, batch_size=2)
    lens = [len(r.prompt_token_ids) for r in trace]
    # batch 1: two rows padded to the longer prompt, 6 tokens (5 after the prefill);
    # batch 2: one row, 2 tokens
    expected = 2 * (max(lens[:2]) + 6 - 1) + (lens[2] + 2 - 1)
    assert hf["positions"] == expected
    assert [len(t) for t in hf["tokens"]] == [3, 6, 2]
    static = run_llmlab(LLM(smollm2, tokenizer, scheduler="static", max_num_seqs=2), trace)
    # llmlab static pads prompts the same way, but a finished row keeps its seat without
    # being computed: 3 positions fewer than HF's for the 3-token request
    assert static["positions"] == expected - (6 - 3)
    cont = run_llmlab(LLM(smollm2, tokenizer, scheduler="continuous", max_num_seqs=2), trace)
    # no pads: every prompt token once, then one position per further token
    assert cont["positions"] == sum(lens) + (3 - 1) + (6 - 1) + (2 - 1)


def test_command_line_is_checked():
    quick = parse_args(["--quick"])
    assert (quick.requests, quick.max_num_seqs, quick.output_scale) == (16, 8, 0.25)
    with pytest.raises(ValueError, match="--requests=-1 must be >= 0"):
        parse_args(["--requests", "-1"])
    with pytest.raises(ValueError, match="--chunk-budget=-2 must be >= 0"):
        parse_args(["--chunk-budget", "-2"])
    with pytest.raises(ValueError, match="--rounds=0 must be >= 1"):
        parse_args(["--rounds", "0"])
