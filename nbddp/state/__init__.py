"""A run's model: one state per run, fed by its events (from the ranks, the judge, the
kernel), read as frozen snapshots by every view and by a detached run's record. Nothing here
draws, or imports IPython: a detached run's supervisor, which has no notebook, keeps its
record with it (``detached/recorder.py``).

``run`` is the model and its ``RunSnapshot``; ``metrics`` the cross-rank averages and the
history; ``recovery`` what is known of stopping well (a graceful stop under way, restarts,
where checkpoints go); ``terminal`` terminal text as a cell shows it (colours, redraws, line
windows) and the stream into the cell; ``transcript`` rank 0's output as the saved summary
keeps it; ``format`` numbers, durations and bars as text.

Non-goal: how a run looks (``display/``).
"""
