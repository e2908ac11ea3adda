# %% [markdown]
# # 13 · Solutions
#
# Each exercise of notebook 13 (caching across requests) with a reference answer and its check.

# %%
import llmlab
from llmlab import exercises

# %% [markdown]
# ## Build: the radix tree's match and insert
#
# `match` walks down from the root. At each node, the child keyed by the next token is the only
# edge that can continue the prefix; count how many of its tokens agree with the prompt's. When
# all of them do, descend and go on; when only `n` do, split the edge after `n` tokens
# (`tree.split` returns the upper node, which ends exactly where the agreement ends) and stop.
# Touch the node at the end, so that its whole path is the most recently used.
#
# `insert` is a match followed by at most one new leaf: the tokens after the matched length hang
# under the node where the match ended, with their blocks taken from the table
# (`tree.add_leaf`). The shared part keeps the tree's own blocks.

# %%
def match(tree, tokens):
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


def insert(tree, tokens, table):
    node, pos = match(tree, tokens)
    if pos < len(tokens):
        node = tree.add_leaf(node, list(tokens[pos:]), table)
        tree.touch(node)
    return node


print(exercises.check("nb13.radix_tree", (match, insert)))

# %% [markdown]
# ## Predict: the share of prompt tokens computed
#
# The reference answer is whatever the measurement says (the check runs the library's radix
# cache on two conversations when no measurement is passed).

# %%
print(exercises.check("nb13.predict_computed_share", "measured"))

# %% [markdown]
# ## Explain: why a match inside a block copies it
#
# The tree's block holds another sequence's K/V in its slots after the match; the new prompt's
# next tokens go to those slots. Sharing it would overwrite the tree's copy, so the new prompt
# writes into a copy of its own (copy-on-write).

# %%
print(exercises.check("nb13.explain_partial_copy", "b"))

