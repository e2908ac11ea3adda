"""The exercises of notebook 13 (caching across requests: a radix prefix cache over the paged
pool, cache-aware admission).

- ``nb13.radix_tree`` (build): the radix tree's ``match`` and ``insert``, compared with the
  library's tree operation by operation, run under the block manager, then by the engine
  serving SmolLM2 on the multi-turn trace.
- ``nb13.explain_partial_copy`` (explain): why a match that ends inside a block copies it.
- ``nb13.predict_computed_share`` (predict): the share of the multi-turn trace's prompt
  tokens the radix cache computes.

The long-context exercises (split-KV decode, attention sinks) are notebook 14's:
:mod:`llmlab.exercises.nb14`.
"""
from __future__ import annotations

from . import Verdict, choice_verdict, exercise, forbid, right, wrong  # noqa: F401

NB = "13_caching_across_requests"

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
