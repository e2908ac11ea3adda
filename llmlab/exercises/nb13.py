"""The exercises of notebook 13 (KV beyond one request: a radix prefix cache, split-KV decode,
attention sinks).

Radix prefix cache:

- ``nb13.radix_tree`` (build): the radix tree's ``match`` and ``insert``, compared with the
  library's tree operation by operation, run under the block manager, then by the engine
  serving SmolLM2 on the multi-turn trace.
- ``nb13.explain_partial_copy`` (explain): why a match that ends inside a block copies it.
- ``nb13.predict_computed_share`` (predict): the share of the multi-turn trace's prompt
  tokens the radix cache computes.

Long contexts (split-KV decode, attention sinks): see the section below.
"""
from __future__ import annotations

from . import Verdict, choice_verdict, exercise, forbid, right, wrong  # noqa: F401

NB = "13_kv_beyond_one_request"

# ---- radix prefix cache ----------------------------------------------------------------------

import functools as _functools

# The student's two functions for the build (``nb13.radix_tree``), answered as a pair::
#
#     match(tree, tokens) -> (node, length)     # node.end == length: split an edge to stop inside it
#     insert(tree, tokens, table) -> node       # the node that ends at len(tokens)
#
# with the tree's helpers (llmlab.cache.radix.RadixCache): tree.root, node.children (by first
# token), node.tokens, node.end, tree.split(node, n), tree.add_leaf(parent, tokens, table),
# tree.touch(node). The checker compares the tree the pair builds with the library's on a
# scripted and a random sequence of operations, runs the block manager on it (every cached
# token's K/V followed slot by slot), then serves SmolLM2 on the multi-turn trace with it:
# the same greedy tokens as no cache, and the library radix cache's hit count.

from . import _raises_not_implemented
from ..cache.block_manager import BlockAllocator as _BlockAllocator
from ..cache.block_manager import BlockManager as _BlockManager
from ..cache.block_manager import NoFreeBlocksError as _NoFreeBlocksError
from ..cache.radix import RadixCache as _RadixCache
from ..cache.radix import radix_insert as _library_insert
from ..cache.radix import radix_match as _library_match

RADIX_SESSIONS = 2            # multi-turn sessions the engine stage serves (3 turns each)
RADIX_TURN_TOKENS = 5         # answer tokens per turn in that stage


def reference_match(tree, tokens):
    """Walk down from the root: the child keyed by the next token, then how many of its
    tokens agree; a whole edge descends, part of one is split there and ends the walk."""
    node, pos = tree.root, 0
    tokens = list(tokens)
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = 0
        while n < min(len(child.tokens), len(tokens) - pos) and child.tokens[n] == tokens[pos + n]:
            n += 1
        if n < len(child.tokens):
            node, pos = tree.split(child, n), pos + n
            break
        node, pos = child, pos + n
    tree.touch(node)
    return node, pos


def reference_insert(tree, tokens, table):
    """The shared part stays; the rest becomes one new leaf under where the match ended."""
    node, pos = reference_match(tree, tokens)
    if pos < len(tokens):
        node = tree.add_leaf(node, list(tokens[pos:]), table)
        tree.touch(node)
    return node


def _match_whole_edges(tree, tokens):
    node, pos = tree.root, 0
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None or list(tokens[pos:pos + len(child.tokens)]) != child.tokens:
            break                                    # never splits: stops at the last whole edge
        node, pos = child, pos + len(child.tokens)
    tree.touch(node)
    return node, pos


def _match_without_split(tree, tokens):
    node, pos = tree.root, 0
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = 0
        while n < min(len(child.tokens), len(tokens) - pos) and child.tokens[n] == tokens[pos + n]:
            n += 1
        node, pos = child, pos + n                   # counts a part of an edge, keeps it whole
        if n < len(child.tokens):
            break
    tree.touch(node)
    return node, pos


def _match_no_touch(tree, tokens):
    node, pos = tree.root, 0
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        n = 0
        while n < min(len(child.tokens), len(tokens) - pos) and child.tokens[n] == tokens[pos + n]:
            n += 1
        if n < len(child.tokens):
            node, pos = tree.split(child, n), pos + n
            break
        node, pos = child, pos + n
    return node, pos                                 # the path is not marked as used


def _insert_returns_match(tree, tokens, table):
    node, pos = reference_match(tree, tokens)
    if pos < len(tokens):
        tree.add_leaf(node, list(tokens[pos:]), table)
    return node                                      # the node above the new leaf


def _insert_without_split(tree, tokens, table):
    node, pos = _match_whole_edges(tree, tokens)     # a second branch beside the shared edge
    if pos < len(tokens):
        node = tree.add_leaf(node, list(tokens[pos:]), table)
        tree.touch(node)
    return node


def _shape(tree) -> list[tuple]:
    """The tree as a sorted list of (start, tokens, blocks, children's first tokens)."""
    return sorted((n.start, tuple(n.tokens), tuple(n.blocks), tuple(sorted(n.children)))
                  for n in tree.nodes())


_SCRIPT = (("insert", list(range(1, 11))), ("match", [1, 2, 3, 4, 5, 6, 7, 99]),
           ("insert", [1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23]), ("match", [1, 2, 3]),
           ("match", [5, 6]), ("match", []), ("insert", [1, 2, 3]),
           ("match", list(range(1, 11))), ("insert", list(range(1, 13))),
           ("match", [1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23, 24]))


def _random_script(seed: int = 3, n: int = 300) -> list[tuple]:
    import random

    rng = random.Random(seed)
    stems = [[rng.randrange(6) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    out = []
    for _ in range(n):
        stem = rng.choice(stems)
        tokens = stem[:rng.randrange(0, len(stem) + 1)] + \
            [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
        out.append(("insert" if rng.random() < 0.5 else "match", tokens))
    return out


def _play(match, insert, script) -> list:
    """Run ``script`` on a fresh tree built by (match, insert); -> what each step saw."""
    alloc = _BlockAllocator(4096, 4)
    tree = _RadixCache(alloc, 4, match=match, insert=insert)
    seen = []
    for op, tokens in script:
        if op == "insert":
            table = [alloc.allocate() for _ in range(-(-len(tokens) // 4))]
            node = tree.insert(tokens, table) if tokens else tree.root
            for b in table:
                alloc.decref(b)                       # the tree keeps what it took
            seen.append(("insert", tokens, node.end, _shape(tree), None))
        else:
            node, length = tree.match(tokens)
            newest = max((n.last_access for n in tree.nodes()), default=0)
            fresh = all(n.last_access == newest for n in tree.path(node))
            seen.append(("match", tokens, length, _shape(tree), fresh))
    return seen


def _compare_trees(match, insert, reference) -> str | None:
    for label, script in (("the scripted operations", _SCRIPT),
                          ("300 random operations", _random_script())):
        got = _play(match, insert, script)
        for i, (g, w) in enumerate(zip(got, reference[label])):
            op, tokens = g[0], g[1]
            call = f"{op}({tokens})"
            if op == "match" and g[2] != w[2]:
                how = ("it stopped at the last whole edge; a match may end inside one, "
                       "which is split there" if g[2] < w[2] else "it counts tokens that differ")
                return (f"in {label}, step {i}: {call} found {g[2]} shared tokens where the "
                        f"tree holds {w[2]}: {how}.")
            if op == "match" and not g[4]:
                return (f"in {label}, step {i}: after {call} the matched path is not the most "
                        "recently used (touch it), so eviction would take it first.")
            if g[3] != w[3]:
                return (f"in {label}, step {i}: after {call} the tree differs from the "
                        f"library's: {len(g[3])} nodes where it has {len(w[3])} (first "
                        f"difference: {next((a for a, b in zip(g[3], w[3]) if a != b), g[3][-1:])}).")
    return None


@_functools.lru_cache(maxsize=1)
def _reference_plays() -> dict:
    return {"the scripted operations": _play(_library_match, _library_insert, _SCRIPT),
            "300 random operations": _play(_library_match, _library_insert, _random_script())}


def _manager_ops(factory, seed: int = 5, n: int = 1500) -> list:
    """Random allocate / append / free on a BlockManager with ``factory``'s tree; what each
    step returned, after checking every computed token's K/V is in its slots."""
    import random

    rng = random.Random(seed)
    bm = _BlockManager(40, 4, prefix_cache=factory)
    slots: dict[int, tuple] = {}
    stems = [[rng.randrange(9) for _ in range(rng.randrange(3, 15))] for _ in range(4)]
    live, tokens, out = [], {}, []

    def copy(pairs):
        for src, dst in pairs:
            for o in range(4):
                slots[dst * 4 + o] = slots.get(src * 4 + o)

    for step in range(n):
        op = rng.random()
        if op < 0.35 or not live:
            stem = rng.choice(stems)
            prompt = stem[:rng.randrange(1, len(stem) + 1)] + [rng.randrange(9)
                                                               for _ in range(rng.randrange(1, 4))]
            if not bm.can_allocate(prompt):
                out.append(("full",))
                continue
            cached = bm.allocate(step, prompt)
            copy(bm.take_copies())
            for pos in range(cached):
                if slots.get(bm.slot(step, pos)) != (pos, prompt[pos]):
                    raise AssertionError(f"a prompt that shares {cached} tokens with the cache "
                                         f"read the wrong K/V at position {pos}")
            for pos in range(cached, len(prompt)):
                slots[bm.slot(step, pos)] = (pos, prompt[pos])
            bm.mark_computed(step, len(prompt))
            live.append(step)
            tokens[step] = list(prompt)
            out.append(("allocate", cached))
        elif op < 0.75:
            sid = rng.choice(live)
            if not bm.can_append(sid):
                out.append(("full",))
                continue
            tok = rng.randrange(9)
            _, cow = bm.append_slot(sid, tok)
            copy([cow] if cow else [])
            tokens[sid].append(tok)
            slots[bm.slot(sid, len(tokens[sid]) - 1)] = (len(tokens[sid]) - 1, tok)
            bm.mark_computed(sid, len(tokens[sid]))
            out.append(("append", cow is not None))
        else:
            bm.free(live.pop(rng.randrange(len(live))))
            out.append(("free",))
        if step % 50 == 0:
            bm.check_invariants()
    return out


@_functools.lru_cache(maxsize=1)
def _reference_manager_ops() -> list:
    return _manager_ops("radix")


def _radix_sessions():
    import llmlab
    from ..engine.sessions import Turn, sessions_of
    from ..traces import load_trace

    tok = llmlab.load_tokenizer("smollm2-135m")
    sessions = sessions_of(load_trace("multiturn_chat", tokenizer=tok))[:RADIX_SESSIONS]
    for s in sessions:
        s.turns = [Turn(t.token_ids, RADIX_TURN_TOKENS, 0.0) for t in s.turns[:3]]
    return sessions


def _serve(prefix_cache):
    import llmlab
    from ..engine.sessions import run_sessions

    model, tok = _smollm2_radix()
    llm = llmlab.LLM(model, tok, prefix_cache=prefix_cache, block_size=16, num_blocks=256)
    run = run_sessions(llm, _radix_sessions(), time_scale=0.0)
    llm.engine.cache.manager.check_invariants()
    return run


@_functools.lru_cache(maxsize=1)
def _smollm2_radix():
    import llmlab

    return llmlab.load_model("smollm2-135m", attention="sdpa"), llmlab.load_tokenizer("smollm2-135m")


@_functools.lru_cache(maxsize=1)
def _reference_serve():
    """The library's radix cache on the sessions (its greedy tokens equal no cache's:
    tests/test_prefix_engine.py)."""
    return _serve("radix")


def _tokens_of(run) -> list:
    return sorted((t.session, t.turn, t.output_token_ids) for t in run.turns)


@exercise("nb13.radix_tree", notebook=NB, kind="build",
          title="build: the radix tree's match and insert",
          solution=(reference_match, reference_insert),
          placeholder=(_raises_not_implemented, _raises_not_implemented),
          wrong_variants={
              "stops at whole edges": ((_match_whole_edges, reference_insert),
                                       ("last whole edge",)),
              "counts without splitting": ((_match_without_split, reference_insert),
                                           ("node ending at",)),
              "forgets to touch": ((_match_no_touch, reference_insert), ("recently used",)),
              "returns the parent": ((reference_match, _insert_returns_match),
                                     ("returned a node ending at",)),
              "branches beside a shared edge": ((reference_match, _insert_without_split),
                                                ("already has a child",)),
              "library wrapper": ((_library_match, _library_insert), ("llmlab's own",)),
          })
def _check_radix_tree(answer, **_) -> Verdict:
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(map(callable, answer))):
        return wrong(f"the answer should be the pair (match, insert) of your two functions; "
                     f"got {type(answer).__name__}.", "pass `(match, insert)`.")
    match, insert = answer
    reference = _reference_plays()
    ops = _reference_manager_ops()
    with forbid(_library_match, _library_insert):
        problem = _compare_trees(match, insert, reference)
        if problem:
            return wrong(problem, "walk from the root: the child keyed by the next token, count "
                         "the agreeing tokens of its edge, split where they stop agreeing.")
        try:
            got = _manager_ops(lambda a, bs: _RadixCache(a, bs, match=match, insert=insert))
        except AssertionError as e:
            return wrong(f"under the block manager: {e}.", "compare tokens, not lengths.")
        if got != ops:
            i = next(i for i, (a, b) in enumerate(zip(got, ops)) if a != b)
            return wrong(f"under the block manager, operation {i} gave {got[i]} where the "
                         f"library's tree gives {ops[i]}.", "check what insert returns.")
    want = _reference_serve()
    with forbid(_library_match, _library_insert):
        run = _serve(lambda a, bs: _RadixCache(a, bs, match=match, insert=insert))
    if _tokens_of(run) != _tokens_of(want):
        return wrong("SmolLM2 served the multi-turn sessions with your tree and generated other "
                     "tokens than with the library's tree (whose tokens are those of no cache): "
                     "a prompt read K/V that is not its own.",
                     "a match must end where the tokens stop agreeing.")
    if run.computed_prompt_tokens != want.computed_prompt_tokens:
        return wrong(f"with your tree the engine computed {run.computed_prompt_tokens} prompt "
                     f"tokens where the library's computes {want.computed_prompt_tokens}.",
                     "the match should find every token the tree holds.")
    return right(f"your tree matches the library's on {len(_SCRIPT) + 300} operations and under "
                 f"the block manager; SmolLM2 served {len(run.turns)} turns of "
                 f"{RADIX_SESSIONS} conversations with it, the same greedy tokens as the "
                 f"library's tree (and no cache), computing {run.computed_prompt_tokens} of {run.prompt_tokens} prompt "
                 f"tokens (hit rate {run.hit_rate:.0%}).")


_PARTIAL_CHOICES = {
    "a": "a block that is not full has no hash, so the tree cannot find it again later",
    "b": "the new prompt writes its own next tokens into that block's later slots",
    "c": "paged attention kernels cannot read a block that two sequences share at once",
    "d": "the copy lets the cache evict the old block while the new sequence runs",
}


@exercise("nb13.explain_partial_copy", notebook=NB, kind="explain",
          title="explain: why does a match that ends inside a block copy that block?",
          solution="b", choices=_PARTIAL_CHOICES,
          wrong_variants={"no hash": ("a", ("hash",))})
def _check_explain_partial_copy(answer, **_) -> Verdict:
    return choice_verdict(answer, "b", {
        "a": "the radix tree finds tokens, not hashes: a partial block is found like any "
             "other. The copy is about writing.",
        "b": "the tree's block keeps another sequence's K/V in the slots after the match; the "
             "new prompt's tokens go to the same slots, so it writes into its own copy "
             "(copy-on-write, as a fork does in notebook 04).",
        "c": "full blocks are shared by many sequences and every backend reads them through "
             "the block tables; reading shared blocks is the point of paging.",
        "d": "the tree's block stays: the match locks its path. The copy exists because of "
             "the write that follows.",
    })


_SHARE_CHOICES = {"a": "more than 90%", "b": "50% to 90%", "c": "20% to 50%",
                  "d": "less than 20%"}


def share_letter(share: float) -> str:
    """The option of ``nb13.predict_computed_share`` a measured share falls in."""
    return "a" if share > 0.9 else "b" if share > 0.5 else "c" if share > 0.2 else "d"


@exercise("nb13.predict_computed_share", notebook=NB, kind="predict",
          title="predict: the share of the multi-turn trace's prompt tokens the radix cache "
                "computes",
          solution="measured", choices=_SHARE_CHOICES,
          wrong_variants={"all of them": ("a", ("measured",))})
def _check_predict_computed_share(answer, measured: float | None = None, **_) -> Verdict:
    if measured is None:
        measured = _reference_serve().computed_share
    want = share_letter(measured)
    if answer == "measured":
        answer = want
    letter = str(answer).strip().lower()[:1]
    if letter not in _SHARE_CHOICES:
        return wrong(f"{answer!r} is not one of the choices {sorted(_SHARE_CHOICES)}.",
                     "answer with a letter, e.g. \"b\".")
    said = f"({letter}) {_SHARE_CHOICES[letter]}"
    if letter == want:
        return right(f"{said}: the run computed {measured:.0%} of the prompt tokens it was sent. "
                     "Each turn resends the conversation; only the new message (and the last "
                     "token, for its logits) is new.")
    return wrong(f"{said}, but the run measured {measured:.0%}, option ({want}).",
                 "count what a turn adds to the conversation against what it resends.")


# ---- long contexts: split-KV decode and attention sinks --------------------------------------
#
# - ``nb13.lse_merge`` (build): merge split-KV partials with their log-sum-exp. Checked on
#   partials of ragged sequences (some splits empty) against unsplit attention, then in every
#   layer of SmolLM2's decode through the paged engine: the same greedy tokens.
# - ``nb13.kv_gib_128k`` (compute): Llama-3-8B's KV cache at 128k tokens, in GiB.
# - ``nb13.explain_sinks`` (explain): why a window alone collapses.
# - ``nb13.sinks_attention`` (build, stretch): one decode query of the sinks cache: which
#   keys it keeps and where RoPE puts them; run token by token on SmolLM2.

import functools as _functools

import torch as _torch

_SPLIT_LENS = (37, 70, 5, 129)        # ragged: not multiples of anything; 5 leaves splits empty
_SPLITS = 4


def reference_merge_splits(o, lse):
    """out = Σ_s exp(lse_s − L) o_s with L = log Σ_s exp(lse_s), the largest lse subtracted
    first so that nothing overflows; a split with lse = -inf weighs nothing."""
    top = lse.max(dim=0).values
    w = _torch.exp(lse - top)                      # [splits, ...]: each split's share, unnormalized
    return (w[..., None] * o).sum(dim=0) / w.sum(dim=0)[..., None]


def _merge_no_rescale(o, lse):
    return o.sum(dim=0)


def _merge_average(o, lse):
    seen = _torch.isfinite(lse)
    return (o * seen[..., None]).sum(dim=0) / seen.sum(dim=0)[..., None]


def _merge_max_for_lse(o, lse):
    top = lse.max(dim=0).values                    # normalizes by the max, not by Σ exp
    return (_torch.exp(lse - top)[..., None] * o).sum(dim=0)


def _merge_library(o, lse):
    from ..attention.split_kv import merge_partials

    return merge_partials(o, lse)[0]


def _merge_forbidden():
    from ..attention import split_kv
    from ..kernels import paged_attn

    out = [split_kv.merge_partials, split_kv.paged_attention_split_reference]
    if hasattr(paged_attn, "paged_attention_split"):
        out.append(paged_attn.paged_attention_split)
    return out


def _split_case(seed: int = 0):
    """Partials of a paged decode at ragged lengths (GQA 9/3 as SmolLM2, head_dim 16), and
    the unsplit output they must merge to."""
    from ..attention.paged import paged_attention_reference
    from ..attention.split_kv import split_kv_partials

    g = _torch.Generator().manual_seed(seed)
    block, kv_heads, heads, d = 8, 3, 9, 16
    need = [-(-n // block) for n in _SPLIT_LENS]
    pool = sum(need) + 2
    k_cache = _torch.randn(pool, block, kv_heads, d, generator=g) * 2   # peaked softmaxes
    v_cache = _torch.randn(pool, block, kv_heads, d, generator=g)
    perm = _torch.randperm(pool, generator=g).tolist()
    table = _torch.full((len(_SPLIT_LENS), max(need)), -1, dtype=_torch.int32)
    for b, nb in enumerate(need):
        table[b, :nb] = _torch.tensor([perm.pop() for _ in range(nb)], dtype=_torch.int32)
    seqlens = _torch.tensor(_SPLIT_LENS, dtype=_torch.int32)
    q = _torch.randn(len(_SPLIT_LENS), 1, heads, d, generator=g)
    want = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    o, lse = split_kv_partials(q, k_cache, v_cache, seqlens, table, _SPLITS, tile=16)
    return o, lse, want


def _diagnose_merge(got, o, lse) -> str:
    """Which known mistake ``got`` equals, as a sentence (or "")."""
    for fn, what in ((_merge_no_rescale, "the plain sum of the partials (no rescaling)"),
                     (_merge_average, "the average of the partials"),
                     (_merge_max_for_lse, "the partials weighted by exp(lse − max) but divided "
                                          "by nothing: the max stands where the log-sum-exp "
                                          "belongs")):
        ref = fn(o, lse)
        if got.shape == ref.shape and _torch.allclose(got.float(), ref.float(), atol=1e-5):
            return f" Your output equals {what}."
    return ""


_MERGE_PROMPTS = ("Explain what a KV cache stores, in two sentences.",
                  "Name three planets and one fact about each.")
_MERGE_TOKENS = 4
_STUDENT_SPLIT_BACKEND = "nb13_student_split"


@_functools.lru_cache(maxsize=1)
def _smollm2():
    import llmlab

    return (llmlab.load_model("smollm2-135m", attention="sdpa"),
            llmlab.load_tokenizer("smollm2-135m"))


@_functools.lru_cache(maxsize=1)
def _unsplit_tokens() -> list[list[int]]:
    """The greedy tokens the checker compares with (unsplit attention, computed once)."""
    model, tok = _smollm2()
    return _engine_tokens(model, tok, "paged_sdpa")


def _engine_tokens(model, tok, paged_attention: str) -> list[list[int]]:
    from ..engine import LLM, SamplingParams

    llm = LLM(model, tok, paged_attention=paged_attention, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=_MERGE_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(list(_MERGE_PROMPTS), params,
                                                         use_tqdm=False)]


def _check_merge_in_model(fn) -> str | None:
    """SmolLM2 through the paged engine, every layer's attention split in 4 and merged by
    ``fn``: greedy tokens against unsplit attention over the same pool."""
    from .. import attention as attn
    from ..attention.split_kv import split_kv_partials
    from ..exercises import first_token_difference

    model, tok = _smollm2()
    want = _unsplit_tokens()

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale=None,
                     causal=True, max_seqlen_k=None):
        o, lse = split_kv_partials(q, k_cache, v_cache, cache_seqlens, block_table, _SPLITS,
                                   softmax_scale=softmax_scale, causal=causal,
                                   max_seqlen_k=max_seqlen_k)
        return fn(o, lse).to(q.dtype)

    attn.register(_STUDENT_SPLIT_BACKEND, attn.get("paged_split").forward,
                  with_kvcache=with_kvcache)
    try:
        with forbid(*_merge_forbidden()):
            got = _engine_tokens(model, tok, _STUDENT_SPLIT_BACKEND)
    finally:
        attn.unregister(_STUDENT_SPLIT_BACKEND)
    for row, (g, w) in enumerate(zip(got, want)):
        if (diff := first_token_difference(g, w)) is not None:
            return (f"in SmolLM2's greedy decode (every layer split in {_SPLITS}), prompt {row}: "
                    f"{diff}")
    return None


@exercise("nb13.lse_merge", notebook=NB, kind="build",
          title="build: merge split-KV partials with their log-sum-exp",
          solution=reference_merge_splits,
          wrong_variants={
              "no rescaling": (_merge_no_rescale, ("plain sum", "differs")),
              "average": (_merge_average, ("average",)),
              "max for lse": (_merge_max_for_lse, ("max stands where",)),
              "library": (_merge_library, ("llmlab's own",)),
          })
def _check_lse_merge(fn, **_) -> Verdict:
    from . import compare_tensors

    o, lse, want = _split_case()
    with forbid(*_merge_forbidden()):
        got = fn(o.clone(), lse.clone())
    if isinstance(got, tuple):
        got = got[0]
    if (problem := compare_tensors(got, want, "your merged output", 1e-5)) is not None:
        return wrong(problem + _diagnose_merge(got, o, lse) +
                     f" (sequences of {list(_SPLIT_LENS)} keys, {_SPLITS} splits; the "
                     "5-key one leaves 3 splits empty, lse = -inf)",
                     "each partial is normalized over its own keys only: weigh it by its "
                     "share of the whole softmax sum, exp(lse_s) / Σ_t exp(lse_t), with the "
                     "largest lse subtracted before exp.")
    if (problem := _check_merge_in_model(fn)) is not None:
        return wrong(problem, "the small case passed: check the dtype and shape you return "
                     "([..., head_dim], float32 is fine).")
    err = float((got - want).abs().max())
    return right(f"merged partials equal unsplit attention (max |error| {err:.1e}, float32 "
                 f"rounding) at ragged lengths with empty splits, and SmolLM2's greedy decode "
                 f"with every layer split in {_SPLITS} gives the unsplit tokens.")


# ---- compute: a KV cache at 128k tokens ------------------------------------------------------

@exercise("nb13.kv_gib_128k", notebook=NB, kind="compute",
          title="compute: Llama-3-8B's KV cache for one 128k-token sequence, in GiB (bfloat16)",
          solution=16.0,
          wrong_variants={"MHA heads": (64.0, ("4", "KV heads")),
                          "K only": (8.0, ("0.5",))})
def _check_kv_gib_128k(answer, **_) -> Verdict:
    from ..profiling.kv_memory import kv_bytes
    from . import number_verdict

    want = kv_bytes("llama-3-8b", context=128 * 1024).total / 2**30
    verdict = number_verdict(answer, want, rel=0.02, unit=" GiB",
                             good=f"{want:.0f} GiB: 2 (K and V) × 32 layers × 8 KV heads × 128 "
                                  "× 2 bytes = 128 KiB a token, times 131,072 tokens; the "
                                  "weights themselves are 16 GB.",
                             hint="per token: 2 × layers × KV heads × head_dim × bytes; "
                                  "Llama-3-8B has 8 KV heads, not 32.")
    if not verdict.passed and isinstance(answer, (int, float)) and want:
        ratio = answer / want
        if abs(ratio - 4) < 0.1:
            return wrong(f"{answer:g} GiB is 4× the answer: that counts 32 KV heads (MHA); "
                         "Llama-3-8B shares each K/V head among 4 query heads (8 KV heads).")
        if abs(ratio - 0.5) < 0.02:
            return wrong(f"{answer:g} GiB is 0.5× the answer: the cache holds K and V.")
    return verdict


# ---- explain: why a window alone collapses ------------------------------------------------------

_SINK_CHOICES = {
    "a": "The evicted tokens held the facts the text refers back to, and without them the "
         "model loses the thread of the argument.",
    "b": "Past the window, RoPE rotates the remaining keys by angles that the model never saw "
         "during its training.",
    "c": "Heads park much of their attention on the first tokens; once those are evicted, "
         "that mass lands on tokens never meant to take it.",
    "d": "The window's keys were computed with the first tokens present, so they no longer "
         "match each other once the first tokens are gone from the cache.",
}
_SINK_EXPLANATIONS = {
    "a": "Losing distant content costs little: the same window with 4 sink tokens, which "
         "add no facts about the text, brings perplexity back near the full cache's.",
    "b": "With positions inside the cache the largest distance is the cache's size, well "
         "inside SmolLM2's training context; and the sinks case uses the same positions.",
    "c": "Right: trained on contexts that always start at the same tokens, heads learn to "
         "park surplus attention on them (attention sinks). Softmax must sum to one, so "
         "once the sinks are evicted that mass is spread over tokens whose values were "
         "never meant to carry it. Keeping 4 of them restores the distribution.",
    "d": "Every cached key is a function of the tokens before it and stays valid; the "
         "window-plus-sinks cache keeps the very same window keys and recovers.",
}


@exercise("nb13.explain_sinks", notebook=NB, kind="explain",
          title="explain: why does perplexity blow up when a sliding window evicts the first "
                "tokens, and why do 4 kept tokens fix it?",
          solution="c", choices=_SINK_CHOICES,
          wrong_variants={"facts": ("a", ("4 sink tokens",)),
                          "rope": ("b", ("inside the cache",))})
def _check_explain_sinks(answer, alone: float | None = None, with_sinks: float | None = None,
                         **_) -> Verdict:
    """``alone``, ``with_sinks``: the run's perplexities over the full cache's, quoted."""
    verdict = choice_verdict(answer, "c", _SINK_EXPLANATIONS)
    if alone is None or with_sinks is None:
        return verdict
    return Verdict(verdict.passed, verdict.message + f" (This run: the window alone at "
                   f"{alone:.2f}× the full cache's perplexity, with 4 sinks {with_sinks:.2f}×.)")


# ---- stretch: one decode query of the sinks cache --------------------------------------------

def reference_sinks_attention(q, k, v, sinks, window, rope):
    """q [b, 1, heads, d]; k, v [b, n, kv_heads, d]: every token so far (the query's own
    last), un-rotated. Keep the first ``sinks`` and the last ``window``, rotate them at
    cache positions 0..c-1 and the query at c-1, attend."""
    n = k.shape[1]
    start = min(n, max(sinks, n - window))          # the window, past the sinks
    kept = _torch.cat([_torch.arange(min(sinks, n)), _torch.arange(start, n)])
    pos = _torch.arange(kept.numel())
    kk = rope(k[:, kept], pos)
    qq = rope(q, pos[-1:])
    group = q.shape[2] // k.shape[2]
    kk, vv = kk.repeat_interleave(group, 2), v[:, kept].repeat_interleave(group, 2)
    scores = _torch.einsum("bqhd,bkhd->bhqk", qq, kk) / q.shape[-1] ** 0.5
    return _torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)


def _sinks_text_positions(q, k, v, sinks, window, rope):
    n = k.shape[1]
    start = min(n, max(sinks, n - window))          # the window, past the sinks
    kept = _torch.cat([_torch.arange(min(sinks, n)), _torch.arange(start, n)])
    kk = rope(k[:, kept], kept)                           # positions in the text
    qq = rope(q, _torch.tensor([n - 1]))
    group = q.shape[2] // k.shape[2]
    kk, vv = kk.repeat_interleave(group, 2), v[:, kept].repeat_interleave(group, 2)
    scores = _torch.einsum("bqhd,bkhd->bhqk", qq, kk) / q.shape[-1] ** 0.5
    return _torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)


def _sinks_no_sinks(q, k, v, sinks, window, rope):
    return reference_sinks_attention(q, k, v, 0, window, rope)


def _sinks_forbidden():
    from ..cache import sinks as S

    return [S.sink_window_attention, S.SinkKVCache.attend]


class _StudentSinksCache:
    """Keeps every token's un-rotated K/V; each decode step calls the student's function on
    all of them, so the function decides what is kept and where RoPE puts it."""

    def __init__(self, model, fn, sinks, window):
        from ..cache.sinks import rope

        attn = model.layers[0].self_attn
        self.fn, self.sinks, self.window = fn, sinks, window
        inv_freq = attn.rotary.inv_freq
        self.rope = lambda x, positions: rope(x, positions, inv_freq)
        self.k = [None] * model.config.num_layers
        self.v = [None] * model.config.num_layers

    def attend(self, layer_idx, q, k, v, backend=None):
        if self.k[layer_idx] is not None:
            k = _torch.cat([self.k[layer_idx], k], 1)
            v = _torch.cat([self.v[layer_idx], v], 1)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return self.fn(q, k, v, self.sinks, self.window, self.rope)


_SINK_TEXT_TOKENS = 24
_SINK_SETTING = (2, 8)


def _check_sinks_in_model(fn) -> tuple[str | None, float]:
    from ..cache.sinks import streaming_nll
    from ..quant.eval import eval_token_ids
    import torch.nn.functional as F

    model, tok = _smollm2()
    ids = _torch.tensor(eval_token_ids(tok, _SINK_TEXT_TOKENS))
    sinks, window = _SINK_SETTING
    want = streaming_nll(model, ids, sinks, window, chunk=_SINK_TEXT_TOKENS)
    cache = _StudentSinksCache(model, fn, sinks, window)
    got = []
    with _torch.inference_mode(), forbid(*_sinks_forbidden()):
        for t in range(ids.numel() - 1):
            logits = model.step(ids[None, t:t + 1], _torch.zeros(1, 1, dtype=_torch.long), cache)
            got.append(F.cross_entropy(logits[0].float(), ids[t + 1:t + 2]))
    got = _torch.stack(got)
    err = float((got - want).abs().max())
    if err > 1e-3:
        t = int((got - want).abs().argmax())
        return (f"on SmolLM2 ({ids.numel()} tokens of text, {sinks} sinks, window {window}), the "
                f"loss of token {t + 1} is {float(got[t]):.3f} nats with yours, "
                f"{float(want[t]):.3f} with llmlab's cache (max |difference| {err:.3g})."), err
    return None, err


@exercise("nb13.sinks_attention", notebook=NB, kind="build", stretch=True,
          title="stretch: one decode query of the sinks cache",
          solution=reference_sinks_attention,
          wrong_variants={"text positions": (_sinks_text_positions, ("cache position",)),
                          "no sinks": (_sinks_no_sinks, ("first",)),
                          "library": (lambda q, k, v, s, w, rope: _sinks_library(q, k, v, s, w),
                                      ("llmlab's own",))})
def _check_sinks_attention(fn, **_) -> Verdict:
    from ..cache.sinks import rope as lib_rope
    from ..layers.rotary import inverse_frequencies
    from . import compare_tensors

    inv_freq = inverse_frequencies(16, 10000.0)
    rope = lambda x, positions: lib_rope(x, positions, inv_freq)   # noqa: E731
    g = _torch.Generator().manual_seed(0)
    for n, sinks, window in ((5, 2, 8), (14, 2, 8), (30, 4, 6), (30, 0, 6)):
        q = _torch.randn(2, 1, 6, 16, generator=g)
        k, v = _torch.randn(2, n, 2, 16, generator=g), _torch.randn(2, n, 2, 16, generator=g)
        want = reference_sinks_attention(q, k, v, sinks, window, rope)
        with forbid(*_sinks_forbidden()):
            got = fn(q, k, v, sinks, window, rope)
        if (problem := compare_tensors(got, want, f"your output (n={n} tokens, sinks={sinks}, "
                                       f"window={window})", 1e-5)) is not None:
            hint = ("keep the first `sinks` tokens and the last `window` (the query's own "
                    "among them); number the kept keys 0..c-1 and rotate each at its cache "
                    "position, the query at c-1.")
            text = _sinks_text_positions(q, k, v, sinks, window, rope)
            if got.shape == text.shape and _torch.allclose(got, text, atol=1e-5):
                problem += (" It matches keys rotated at their positions in the text, not "
                            "their cache position.")
            elif sinks and n > sinks + window:
                plain = reference_sinks_attention(q, k, v, 0, window, rope)
                if got.shape == plain.shape and _torch.allclose(got, plain, atol=1e-5):
                    problem += " It matches a window without the first tokens kept."
            return wrong(problem, hint)
    problem, err = _check_sinks_in_model(fn)
    if problem is not None:
        return wrong(problem, "the random cases passed: check the dtype you return and the "
                     "grouped heads (query head h reads KV head h // group).")
    return right(f"your query matches the literal rule on random cases, and on SmolLM2 token by "
                 f"token it gives llmlab's chunked cache's losses (max |difference| {err:.1e}).")


def _sinks_library(q, k, v, sinks, window):
    from ..cache.sinks import sink_window_attention
    from ..layers.rotary import inverse_frequencies

    n = k.shape[1]
    return sink_window_attention(q, k, v, _torch.tensor([n - 1]), _torch.arange(n), sinks,
                                 window, inverse_frequencies(q.shape[-1], 10000.0))
