# %% [markdown]
# # 05 · Solutions
#
# The exercises of notebook 05 with their solutions, each followed by its check.

# %%
from llmlab import exercises
from llmlab.engine.scheduler import SchedulerOutput
from llmlab.exercises.nb05 import admit, cached_blocks, decode_one, requeue

# %% [markdown]
# ### Exercise 1: predict the iterations saved
#
# A static batch of 8 lasts as long as the longest of its 8 answers. Answers of 8–128 tokens
# spread widely, so a batch's longest is about twice its mean, and static batching needs about
# twice the iterations of a scheduler that keeps every seat busy: the measurement says 1.77×.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb05.predict_speedup", 1.8)

# %% [markdown]
# ### Exercise 2: one step of continuous batching
#
# Decodes first, oldest first; when a sequence needs a block and none is free, the newest running
# sequence gives its blocks back and waits again at the front of the queue (it may be the
# sequence itself). A step that preempted admits nobody. Then newcomers in order, while a seat,
# the token budget and the pool allow (the first prompt of an empty step may exceed the budget).

# %%
def schedule(sched, now):
    out = SchedulerOutput(packed=True)
    cfg, bm = sched.config, sched.bm
    for seq in list(sched.running):             # 1. everyone running decodes, oldest first
        if seq not in sched.running:
            continue                            # preempted a moment ago, as a victim
        while not bm.can_append(seq.seq_id):     # no block for it: preempt the newest
            victim = sched.running[-1]
            bm.free(victim.seq_id)
            sched.running.remove(victim)
            requeue(sched, victim)
            out.preempted.append(victim)
            if victim is seq:
                break
        else:
            decode_one(sched, seq, out)
    if out.preempted:                           # 2. memory is tight: nobody joins
        return out
    used = len(out.scheduled)
    while sched.waiting:                        # 3. newcomers, first come first served
        seq = sched.waiting[0]
        if seq.request.arrival_time > now or len(sched.running) >= cfg.max_num_seqs:
            break
        if out.scheduled and used + seq.num_tokens > cfg.max_num_batched_tokens:
            break
        if not bm.can_allocate(seq.all_token_ids):
            break
        used += admit(sched, seq, out)
    return out


exercises.check("nb05.schedule", schedule)

# %% [markdown]
# ### Exercise 3: cu_seqlens
#
# A running sum that starts at 0.

# %%
# NBVAL_CHECK_OUTPUT
import itertools


def cu_seqlens(lengths):
    return [0] + list(itertools.accumulate(lengths))


exercises.check("nb05.cu_seqlens", cu_seqlens)

# %% [markdown]
# ### Exercise 4: the worst stall
#
# The worst stall is one step: without chunks the step that feeds the longest prompt (about 120
# tokens here) beside a decode, with chunks one that feeds at most 64. With the fitted step cost
# (fixed part plus tokens times the cost per prompt token), (36 + 4 + 118 · 1.1) / (36 + 4 +
# 63 · 1.1) ≈ 1.5 on a 2-core CPU; the notebook checks the prediction against its own run.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb05.predict_stall", 1.5)

# %% [markdown]
# ### Exercise 5: static iterations
#
# The batches [5, 60, 8, 12] and [90, 7, 3, 40] last 60 and 90 iterations.

# %%
# NBVAL_CHECK_OUTPUT
out_lengths = [5, 60, 8, 12, 90, 7, 3, 40]
exercises.check("nb05.static_steps", max(out_lengths[:4]) + max(out_lengths[4:]))

# %% [markdown]
# ### Stretch: a prefix-cache-aware admission policy
#
# Reorder the arrived part of the queue by how many leading blocks are cached (most first; a
# stable sort keeps arrival order among equals), then take exercise 2's step.

# %%
# NBVAL_CHECK_OUTPUT
def prefix_aware(sched, now):
    arrived = [s for s in sched.waiting if s.request.arrival_time <= now]
    later = [s for s in sched.waiting if s.request.arrival_time > now]
    arrived.sort(key=lambda s: -cached_blocks(sched, s))
    sched.waiting.clear()
    sched.waiting.extend(arrived + later)
    return schedule(sched, now)


exercises.check("nb05.prefix_aware", prefix_aware)
