"""Notebook 12's figures and widget callback (llmlab.viz.structured)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import llmlab  # noqa: E402
from llmlab.structured import compile_grammar  # noqa: E402
from llmlab.viz.structured import (SchemaTrace, allowed_fractions, explore_schema,  # noqa: E402
                                   plot_mask_costs)


def test_allowed_fractions_follow_an_output_and_refuse_a_wrong_token():
    tok = llmlab.load_tokenizer("smollm2-135m")
    g = compile_grammar({"regex": r'\{"n":[0-9]{1,3}\}'}, tok, 49152, 2)
    ids = tok.encode('{"n":42}', add_special_tokens=False)
    fr = allowed_fractions(g, ids)
    assert len(fr) == len(ids) and (fr > 0).all() and (fr < 0.01).all()
    with pytest.raises(ValueError, match="not allowed"):
        allowed_fractions(g, tok.encode('{"m":1}', add_special_tokens=False))


def test_explore_schema_draws_and_summarizes():
    traces = {"t": SchemaTrace("t", ["{", "a", "}"], 100,
                               {"llmlab": np.array([0.01, 0.5, 0.01])})}
    msg = explore_schema(traces, "t", log_scale=True)
    assert "2 of 3 steps left exactly one token" in msg
    with pytest.raises(ValueError, match="allowed"):
        explore_schema(traces, "nope")
    ax = plot_mask_costs([{"method": "m", "median_s": 1e-4, "p10_s": 5e-5, "p90_s": 2e-4}], 0.03)
    assert ax.get_xscale() == "log"
    plt.close("all")
