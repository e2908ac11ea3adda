"""Tensor parallelism: the parallel layers, the shard loader, launch, and TP = 1 parity.

Spawning ranks costs seconds each on a small CPU, so each multi-process test spawns once
and checks several things.
"""
import pytest
import torch

import llmlab
from llmlab.generate import encode_prompts
from llmlab.config import ModelConfig
from llmlab.layers.linear import (ColumnParallelLinear, RowParallelLinear,
                                  VocabParallelEmbedding, count_collectives)
from llmlab.models.loader import read_state_dict, to_llmlab_names
from llmlab.models import resolve
from llmlab.parallel import (RankError, build_tp_model, check_tp_degree, launch, load_tp_model,
                             parameter_bytes, valid_tp_degrees)
from llmlab.parallel.workers import (generate_on_ranks, mlp_backward_on_ranks, parity_on_ranks,
                                     run_sequence)

from .conftest import FRANCE


def max_abs(a, b):
    return (a - b).abs().max().item()


def test_column_shards_concatenate_and_row_shards_sum_to_the_full_linear():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(12, 8, generator=g), torch.randn(3, 8, generator=g)
    tp = 4
    cols = []
    for r in range(tp):
        layer = ColumnParallelLinear(8, 12, tp_rank=r, tp_size=tp)
        a, b = layer.shard_range()
        layer.weight.data.copy_(w[a:b])
        cols.append(layer(x))  # no communication in a column layer's forward
    assert max_abs(torch.cat(cols, -1), x @ w.T) < 1e-6
    h, w2 = torch.randn(3, 12, generator=g), torch.randn(8, 12, generator=g)
    partial = 0
    for r in range(tp):
        row = RowParallelLinear(12, 8, tp_rank=r, tp_size=tp)
        a, b = row.shard_range()
        assert row.weight.shape == (8, 3)
        row.weight.data.copy_(w2[:, a:b])
        partial = partial + torch.nn.functional.linear(h[:, a:b], row.weight)  # rank r's addend
    assert max_abs(partial, h @ w2.T) < 1e-5
    # without a process group a split layer refuses to return a partial sum
    with pytest.raises(RuntimeError, match="initialized process group"):
        RowParallelLinear(12, 8, tp_rank=0, tp_size=2)(h[:, :6])
    with pytest.raises(RuntimeError, match="initialized process group"):
        VocabParallelEmbedding(16, 4, tp_rank=0, tp_size=2)(torch.tensor([1, 9]))
    with pytest.raises(ValueError, match="out_features=12 is not divisible .* degree 5"):
        ColumnParallelLinear(8, 12, tp_rank=0, tp_size=5)


def test_valid_degrees_and_a_clear_refusal():
    smol = ModelConfig.from_file(resolve("smollm2-135m"))
    tiny = ModelConfig.from_file(resolve("tiny-llama"))
    assert valid_tp_degrees(smol) == [1, 3]
    assert valid_tp_degrees(tiny) == [1, 2, 4]
    check_tp_degree(smol, 3)
    with pytest.raises(ValueError, match=r"tp=2 .*num_heads=9, num_kv_heads=3.*valid degrees: \[1, 3\]"):
        check_tp_degree(smol, 2)
    with pytest.raises(ValueError, match=r"tp=8 .*valid degrees: \[1, 2, 4\]"):
        build_tp_model(tiny, 0, 8)
    moe = ModelConfig.from_file(resolve("tiny-mixtral"))
    with pytest.raises(ValueError, match="dense models"):
        check_tp_degree(moe, 2)


def test_loader_reads_only_this_ranks_slices():
    full = to_llmlab_names(read_state_dict(resolve("smollm2-135m")), llmlab.ModelConfig.from_file(
        resolve("smollm2-135m")))
    m = load_tp_model("smollm2-135m", tp_rank=1, tp_size=3)  # no process group needed to load
    attn, mlp = m.layers[4].self_attn, m.layers[4].mlp
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
    assert torch.equal(attn.q_proj.weight, full["layers.4.self_attn.q_proj.weight"][192:384])
    assert torch.equal(attn.k_proj.weight, full["layers.4.self_attn.k_proj.weight"][64:128])
    assert torch.equal(attn.o_proj.weight, full["layers.4.self_attn.o_proj.weight"][:, 192:384])
    assert torch.equal(mlp.down_proj.weight, full["layers.4.mlp.down_proj.weight"][:, 512:1024])
    assert torch.equal(m.embed_tokens.weight, full["embed_tokens.weight"][16384:32768])
    assert m.lm_head.weight is m.embed_tokens.weight  # tied, one shard
    full_bytes = sum(t.numel() * t.element_size() for k, t in full.items() if k != "lm_head.weight")
    replicated = sum(t.numel() * 4 for k, t in full.items() if "norm" in k)
    assert m.tp_bytes_read == parameter_bytes(m)
    assert abs(m.tp_bytes_read - (full_bytes - replicated) / 3 - replicated) < 1024


def test_launch_refuses_unimportable_functions_and_reports_a_failing_rank():
    with pytest.raises(ValueError, match="must be importable"):
        launch(lambda: 1, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        launch(parity_on_ranks, 0)
    # two ranks asked to split smollm2's 9 heads: each raises, the parent names the cause
    with pytest.raises(RankError, match=r"rank \d of 2 failed: ValueError: .*valid degrees: \[1, 3\]"):
        launch(generate_on_ranks, 2, "smollm2-135m", [1, 2, 3], 2)


@pytest.mark.slow
def test_smollm2_tp3_matches_one_process(smollm2, tokenizer):
    ids = torch.tensor(encode_prompts(tokenizer, [FRANCE], chat=True))
    with torch.no_grad():
        ref = smollm2(ids)
    ref_tokens = llmlab.generate(smollm2, tokenizer, FRANCE, max_new_tokens=4).token_ids
    run = launch(parity_on_ranks, 3, "smollm2-135m", ids, 4, smollm2.config.eos_token_id)
    assert run.tp == 3 and run.logits.shape == ref.shape
    assert max_abs(run.logits, ref) <= 1e-4
    assert run.tokens == ref_tokens and len(ref_tokens) == 4  # "The capital of France"
    assert [(m.heads, m.kv_heads) for m in run.memory] == [(3, 1)] * 3
    one = parameter_bytes(smollm2)
    for m in run.memory:  # each rank holds a third of the split weights plus the norms
        assert 0.33 * one < m.param_bytes < 0.34 * one
    # two all-reduces per layer + one for the embedding, one all-gather of the logits
    ops = [op for op, _ in run.collectives]
    assert ops.count("all_reduce") == 2 * 30 + 1 and ops.count("all_gather") == 1
    assert {b for op, b in run.collectives if op == "all_reduce"} == {576 * 4}


@pytest.mark.slow
def test_tiny_llama_tp2_and_tp4_match_one_process_and_backward_too():
    model = llmlab.load_model("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
    ref_run = run_sequence([(parity_on_ranks, ("tiny-llama", ids, 6))])[0]  # tp = 1, in process
    ref_mlp = mlp_backward_on_ranks(16, 24, 5)
    assert max_abs(ref_run.logits, ref) <= 1e-5
    for tp in (2, 4):
        run, mlp = launch(run_sequence, tp, [(parity_on_ranks, ("tiny-llama", ids, 6)),
                                             (mlp_backward_on_ranks, (16, 24, 5))])
        assert run.tp == tp
        assert max_abs(run.logits, ref) <= 1e-4, tp
        assert run.tokens == ref_run.tokens, tp
        assert [(m.heads, m.kv_heads) for m in run.memory] == [(8 // tp, 4 // tp)] * tp
        for key in ("y", "x_grad", "w_up_grad", "w_down_grad"):
            assert mlp[key].shape == ref_mlp[key].shape
            assert max_abs(mlp[key], ref_mlp[key]) <= 1e-5, (tp, key)


def test_counting_collectives_in_one_process_sees_none():
    model = llmlab.load_model("tiny-llama")
    with torch.no_grad(), count_collectives() as log:
        model(torch.tensor([[1, 2, 3]]))
    assert log.count() == 0 and log.bytes() == 0


def test_count_c10d_ops_sees_torch_distributed_called_directly(tmp_path):
    """The dispatcher-level counter sees dist.all_reduce / all_gather however they were
    imported (llmlab's count_collectives sees only llmlab's own wrappers)."""
    import torch.distributed as dist
    from torch.distributed import all_reduce as renamed

    from llmlab.profiling import count_c10d_ops

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        x = torch.ones(3)
        with count_c10d_ops() as counts, count_collectives() as log:
            dist.all_reduce(x)
            renamed(x)
            dist.all_gather([torch.empty(3)], x)
            x + 1                                  # not a collective
        assert counts == {"allreduce": 2, "allgather": 1}
        assert log.count() == 0
    finally:
        dist.destroy_process_group()
