"""MoE dispatch strategies (dense, loop, grouped) and routing statistics."""
import math

import pytest
import torch

import llmlab
from llmlab.layers.moe import (DISPATCH, SparseMoE, dispatch_grouped, group_by_expert, moe_layers,
                               route, set_dispatch)
from llmlab.layers import moe_stats as S

from .conftest import KERNEL_DEVICE, hf_model


def max_abs(a, b):
    return (a - b).abs().max().item()


def random_routing(tokens, experts, k, hidden=24, inter=40, seed=0, skip=()):
    """Random x, expert weights and a routing that never picks the experts in ``skip``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate = torch.randn(experts, inter, hidden, generator=g) * 0.2
    w_up = torch.randn(experts, inter, hidden, generator=g) * 0.2
    w_down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(skip)] = -1e9
    weights, ids = route(logits, k)
    return x, weights, ids, (w_gate, w_up, w_down)


@pytest.fixture(scope="module")
def tiny_mixtral():
    return llmlab.load_model("tiny-mixtral"), hf_model("tiny-mixtral")


def test_three_dispatches_match_transformers_on_tiny_mixtral(tiny_mixtral):
    model, hf = tiny_mixtral
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.no_grad():
        ref = hf(ids).logits
        for name in ("dense", "loop", "grouped"):
            set_dispatch(model, name)
            out[name] = model(ids)
            assert max_abs(out[name], ref) <= 1e-4, name
    set_dispatch(model, "loop")
    assert max_abs(out["dense"], out["grouped"]) <= 1e-5
    assert max_abs(out["loop"], out["grouped"]) <= 1e-5


def test_grouped_with_the_triton_kernel_matches_loop_on_a_tiny_mixtral_layer(tiny_mixtral):
    model, _ = tiny_mixtral
    moe = model.layers[0].mlp
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = moe(x)
        w, e = moe.last_routing
        args = [t.to(KERNEL_DEVICE) for t in (x, w, e, moe.w_gate, moe.w_up, moe.w_down)]
        tri = dispatch_grouped(*args, impl="triton").cpu()
    assert max_abs(tri, ref) <= 1e-5


@pytest.mark.parametrize("tokens,experts,k,skip", [(1, 4, 2, ()), (50, 8, 2, (0, 5, 7)),
                                                   (33, 6, 1, (2,)), (17, 4, 4, ())])
def test_dispatches_agree_with_empty_experts(tokens, experts, k, skip):
    x, w, ids, weights = random_routing(tokens, experts, k, skip=skip)
    assert not set(skip) & set(ids.flatten().tolist())
    ref = DISPATCH["loop"](x, w, ids, *weights)
    for name in ("dense", "grouped"):
        assert max_abs(DISPATCH[name](x, w, ids, *weights), ref) <= 1e-5, name
    on_kernel = [t.to(KERNEL_DEVICE) for t in (x, w, ids, *weights)]
    assert max_abs(dispatch_grouped(*on_kernel, impl="triton").cpu(), ref) <= 1e-5
    # the definition, token by token
    silu = torch.nn.functional.silu
    t = tokens - 1
    by_hand = sum(w[t, j] * (weights[2][e] @ (silu(weights[0][e] @ x[t]) * (weights[1][e] @ x[t])))
                  for j, e in enumerate(ids[t].tolist()))
    assert max_abs(ref[t], by_hand) <= 1e-5


def test_route_is_softmax_topk_renormalized():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    w, e = route(logits, 2)
    assert e.tolist() == [[0, 2]]
    p = torch.softmax(logits, -1)[0]
    assert torch.allclose(w[0], torch.stack([p[0], p[2]]) / (p[0] + p[2]))


def test_group_by_expert_sorts_pairs_and_counts():
    ids = torch.tensor([[3, 0], [0, 1], [3, 1], [2, 0]])
    order, token, offsets = group_by_expert(ids, 5)
    assert offsets.tolist() == [0, 3, 5, 6, 8, 8]  # expert 4 is empty
    assert ids.reshape(-1)[order].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert token.tolist() == [0, 1, 3, 1, 2, 3, 0, 2]  # stable: token order inside an expert


def test_set_dispatch_switches_every_layer_and_names_bad_values(tiny_mixtral):
    model, _ = tiny_mixtral
    set_dispatch(model, "grouped")
    assert {m.dispatch for m in moe_layers(model)} == {"grouped"} and len(moe_layers(model)) == 2
    set_dispatch(model, "loop")
    with pytest.raises(ValueError, match=r"unknown MoE dispatch 'sparse'; allowed: \['dense', 'loop', 'grouped'\]"):
        set_dispatch(model, "sparse")
    with pytest.raises(ValueError, match="unknown MoE dispatch"):
        SparseMoE(8, 16, 4, 2, dispatch="fast")
    with pytest.raises(ValueError, match="no MoE layers"):
        set_dispatch(llmlab.load_model("tiny-llama"), "grouped")


# -- routing statistics ----------------------------------------------------------------------
def test_balance_loss_is_alpha_when_uniform_and_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    # 8 tokens, 4 experts, top-1, perfectly uniform: each expert gets 2 tokens, P = 1/4
    ids = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    assert S.load_balancing_loss(torch.zeros(8, 4), ids, alpha=0.01) == pytest.approx(0.01)
    # everything on one expert with a confident router: close to alpha * N
    logits = torch.tensor([[20.0, 0, 0, 0]]).repeat(8, 1)
    assert S.load_balancing_loss(logits, torch.zeros(8, 1, dtype=torch.long), alpha=1.0) == \
        pytest.approx(4.0, rel=1e-6)
    # HF sums f over the k slots: k times ours (alpha = 1)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    _, ids = route(logits, 2)
    hf = float(load_balancing_loss_func((logits,), num_experts=8, top_k=2))
    assert S.load_balancing_loss(logits, ids, alpha=1.0) * 2 == pytest.approx(hf, rel=1e-5)


def test_capacity_drops_second_choices_first():
    # 4 tokens, 2 experts, top-2: each expert is asked 4 times; cf=0.5 -> capacity 2
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    res = S.simulate_capacity(ids, 2, capacity_factor=0.5)
    assert res.capacity == 2 == S.expert_capacity(4, 2, 2, 0.5)
    assert res.load.tolist() == [4, 4] and res.dropped.tolist() == [2, 2]
    # first choices fill first: expert 0 takes tokens 0, 1 (token 2's first choice is dropped),
    # expert 1 takes token 3; then second choices: token 0's fits expert 1, the rest are full
    assert res.kept.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert res.drop_fraction == 0.5 and res.tokens_fully_dropped == 1
    assert S.simulate_capacity(ids, 2, capacity_factor=1.0).drop_fraction == 0.0
    w = torch.full((4, 2), 0.5)
    assert S.apply_capacity(w, res.kept).sum().item() == 2.0
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        S.expert_capacity(4, 2, 2, 0)


def test_capacity_never_exceeded_and_kept_plus_dropped_is_load():
    _, _, ids, _ = random_routing(301, 8, 2, seed=4)
    for cf in (0.5, 1.0, 1.25, 2.0):
        res = S.simulate_capacity(ids, 8, cf)
        kept_per_expert = torch.bincount(ids[res.kept], minlength=8)
        assert int(kept_per_expert.max()) <= res.capacity == math.ceil(cf * 301 * 2 / 8)
        assert (kept_per_expert + res.dropped).tolist() == res.load.tolist()


def test_layer_loads_and_report_from_a_forward_pass(tiny_mixtral):
    model, _ = tiny_mixtral
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids)
    loads = S.layer_loads(model)
    assert loads.shape == (2, 4) and loads.sum(1).tolist() == [80, 80]
    report = S.routing_report(model, capacity_factor=1.0)
    assert [r.layer for r in report] == [0, 1]
    assert all(r.balance_loss >= 0.01 * 0.99 and r.max_over_mean >= 1.0 for r in report)
    with pytest.raises(ValueError, match="no MoE layers"):
        S.layer_loads(llmlab.load_model("tiny-llama"))


def test_compute_account_reproduces_the_mixtral_paper_figures():
    acc = S.compute_account(S.MIXTRAL_8X7B, "Mixtral 8x7B")
    assert abs(acc.total_params - S.MIXTRAL_PAPER_TOTAL_PARAMS) / S.MIXTRAL_PAPER_TOTAL_PARAMS < 0.02
    assert abs(acc.active_params - S.MIXTRAL_PAPER_ACTIVE_PARAMS) / S.MIXTRAL_PAPER_ACTIVE_PARAMS < 0.02
    assert 2 * acc.active_params * 0.95 < acc.flops_per_token < 2 * acc.active_params
    assert acc.flops_per_token_all_experts > 3.5 * acc.flops_per_token
    dense = S.compute_account(llmlab.ModelConfig.from_file(
        llmlab.models.resolve("tiny-llama")))
    assert dense.total_params == dense.active_params
    assert dense.flops_per_token == dense.flops_per_token_all_experts


# -- notebook 06 helpers: the widget callback and the exercise checks ----------------------
def test_explore_routing_callback():
    import matplotlib

    matplotlib.use("Agg")
    from llmlab.viz.moe import explore_routing

    fig, st = explore_routing(num_experts=8, top_k=2, capacity_factor=1.25, tokens=256, skew=0.0)
    assert fig is not None and sum(st.load) == 512 and st.capacity == 80
    assert st.active_fraction == 0.25
    _, lopsided = explore_routing(8, 2, 1.25, tokens=256, skew=2.0, show=False)
    assert lopsided.drop_fraction > st.drop_fraction and lopsided.balance_loss > st.balance_loss
    _, roomy = explore_routing(8, 2, 8.0, tokens=256, skew=2.0, show=False)
    assert roomy.drop_fraction == 0.0  # capacity for everything
    with pytest.raises(ValueError, match="top_k=9 must be in 1..num_experts=8"):
        explore_routing(8, 9, 1.0)


def test_bench_sweeps_run_small_and_gpu_flag_degrades(capsys):
    from llmlab.bench import moe as bench

    rows = bench.sweep_tokens([5, 40], dict(hidden=32, inter=48), "cpu", torch.float32, repeats=1)
    assert [r["tokens"] for r in rows] == [5, 40]
    assert all(float(r["max |Δ| vs loop"]) <= 1e-5 and r["dense ms"] > 0 for r in rows)
    erows = bench.sweep_experts([2, 4], 16, dict(hidden=32, inter=48), "cpu", torch.float32, repeats=1)
    assert [r["experts"] for r in erows] == [2, 4] and erows[1]["params (M)"] == 2 * erows[0]["params (M)"]
    import matplotlib

    matplotlib.use("Agg")
    from llmlab.viz.moe import (measure_dispatch, median_of, plot_compute_accounts,
                                plot_dispatch_times, plot_layer_loads)

    trows, xrows = measure_dispatch([3, 20], [2, 4], fixed_tokens=8, shape=dict(hidden=32, inter=48))
    assert [r["tokens"] for r in trows] == [3, 20] and [r["experts"] for r in xrows] == [2, 4]
    assert all(len(r[f"{s} ms"]) == 5 for r in trows for s in ("dense", "loop", "grouped"))
    assert "loop µs/token" not in xrows[0] and len(xrows[1]["grouped µs/token"]) == 5
    assert median_of(trows[0], "dense ms") == sorted(trows[0]["dense ms"])[2]
    with pytest.raises(ValueError, match="repeats=3"):
        measure_dispatch([3], [2], repeats=3)
    assert len(plot_dispatch_times(trows, xrows, "cpu").axes) == 2
    assert len(plot_layer_loads(torch.tensor([[3, 1], [2, 2]])).axes) == 2  # heatmap + colorbar
    assert len(plot_compute_accounts([S.compute_account(S.MIXTRAL_8X7B, "m")]).axes) == 1
    if not torch.cuda.is_available():
        assert bench.main(["--gpu"]) == 0
        assert "needs CUDA" in capsys.readouterr().out


def test_a_registered_dispatch_routes_for_itself_and_can_be_removed(tiny_mixtral):
    from llmlab.layers.moe import available_dispatches, register_dispatch, unregister_dispatch

    model, _ = tiny_mixtral
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    seen = []

    def mine(x, logits, k, w_gate, w_up, w_down):  # the library's two halves, called by name
        seen.append((tuple(x.shape), tuple(logits.shape), k))
        return dispatch_grouped(x, *route(logits, k), w_gate, w_up, w_down)

    with torch.no_grad():
        set_dispatch(model, "loop")
        ref = model(ids)
        register_dispatch("mine", mine)
        try:
            assert available_dispatches() == ["dense", "loop", "grouped", "mine"]
            set_dispatch(model, "mine")
            assert max_abs(model(ids), ref) <= 1e-5
            assert seen == [((12, 64), (12, 4), 2)] * 2  # both layers, raw logits, top-2
            assert moe_layers(model)[0].last_routing[1].shape == (12, 2)  # statistics still kept
        finally:
            set_dispatch(model, "loop")
            unregister_dispatch("mine")
    assert available_dispatches() == ["dense", "loop", "grouped"]
    with pytest.raises(ValueError, match="built-in dispatch"):
        register_dispatch("grouped", mine)
    with pytest.raises(ValueError, match="no registered dispatch 'mine'"):
        unregister_dispatch("mine")
    with pytest.raises(ValueError, match="must be callable"):
        register_dispatch("x", 3)


def test_gpu_model_of_a_moe_layer():
    one, mid, big = (S.moe_layer_gpu_model(n) for n in (1, 64, 8192))
    # batch 1: grouped reads 2 of 8 experts; memory-bound, so 4x faster
    assert one.experts_touched == pytest.approx(2.0) and one.dense_over_grouped == pytest.approx(4.0, rel=1e-3)
    # 64 tokens touch every expert: both read all weights and are memory-bound alike
    assert mid.experts_touched > 7.99 and mid.dense_over_grouped == pytest.approx(1.0, abs=0.02)
    # large batch: compute-bound, the FLOP ratio E/k returns
    assert big.dense_over_grouped == pytest.approx(4.0, rel=1e-2)
    assert big.dense_flops == 4 * big.grouped_flops
    with pytest.raises(ValueError, match="top_k"):
        S.moe_layer_gpu_model(4, experts=2, top_k=3)
    import matplotlib

    matplotlib.use("Agg")
    from llmlab.viz.moe import plot_moe_gpu_model

    fig, est = plot_moe_gpu_model([1, 16, 4096])
    assert fig._suptitle.get_text().startswith("MODEL") and len(est) == 3
