# %% [markdown]
# # 12 · Solutions
#
# Each exercise of notebook 12 with a reference answer and its check.

# %%
import numpy as np

from llmlab import exercises

# %% [markdown]
# ## Build: the token table
#
# The code points become classes once (`dfa.classify`; −1 stays −1 past a token's end). Then per
# state, all whole-character tokens start together in that state; at character position `j` the
# tokens that still have a `j`-th character take one transition, and those that land on −1 drop
# out. What is left when no token has more characters is the row: each surviving token and the
# state it ended in. The end-of-sequence token is allowed exactly where the state accepts.

# %%
def token_table(dfa, vocab):
    num_states, v = dfa.num_states, vocab.vocab_size
    cp = vocab.codepoints
    classes = np.where(cp >= 0, dfa.classify(np.maximum(cp, 0)), -1)
    allowed = np.zeros((num_states, v), dtype=bool)
    next_state = np.full((num_states, v), -1, dtype=np.int64)
    for s in range(num_states):
        ids = np.nonzero(vocab.independent)[0]
        state = np.full(len(ids), s, dtype=np.int64)
        for j in range(cp.shape[1]):
            longer = vocab.lengths[ids] > j
            if not longer.any():
                break
            state[longer] = dfa.transitions[state[longer], classes[ids[longer], j]]
            keep = state >= 0
            ids, state = ids[keep], state[keep]
        allowed[s, ids] = True
        next_state[s, ids] = state
        allowed[s, vocab.eos_token_id] = dfa.accepting[s]
    return allowed, next_state


print(exercises.check("nb12.token_table", token_table))

# %% [markdown]
# ## Predict: the share allowed inside a string
#
# A guess is judged against the measurement; the reference answer is the measurement's option.

# %%
from llmlab.exercises.nb12 import fraction_letter, measured_string_fraction

share = measured_string_fraction()
print(f"measured share {share:.1%}: option ({fraction_letter(share)})")
print(exercises.check("nb12.predict_allowed_fraction", fraction_letter(share), measured=share))

# %% [markdown]
# ## Predict: a naive tool-call stream

# %%
# NBVAL_CHECK_OUTPUT
print(exercises.check("nb12.predict_naive_tool_stream", "b"))

# %% [markdown]
# ## Stretch: the streaming parser
#
# Wait until the text up to `"arguments":` has arrived (a regex over the buffer), then read the
# arguments one character at a time: track whether we are inside a string (and after a
# backslash in it), count `{`/`[` up and `}`/`]` down outside strings, and stop at the
# character that brings the count back to zero. Each piece shows what was read during it.

# %%
import re


def stream_arguments(pieces):
    head = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*')
    buffer, start, pos, depth = "", None, 0, 0
    in_string = escaped = done = False
    out = []
    for piece in pieces:
        buffer += piece
        if start is None:
            m = head.match(buffer)
            if m is None:
                out.append("")
                continue
            start = pos = m.end()
        begin = pos
        while pos < len(buffer) and not done:
            c = buffer[pos]
            pos += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                done = depth == 0
        out.append(buffer[begin:pos])
    return out


# NBVAL_CHECK_OUTPUT
print(exercises.check("nb12.stream_arguments", stream_arguments))
