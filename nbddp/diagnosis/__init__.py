"""Why is it stuck? Where every rank is (``Run.stacks``), grouped into a roll-call that names
the odd one out (``stacks.py``), the answers as they arrive (``answers.py``), and the watch that
shows the roll-call when no rank made progress for ``stall_after`` seconds (``stall.py``).

The ranks' side is ``worker/diagnosis/stacks.py``; a rank that cannot answer is dumped by a signal
(``local/stack_dumps.py``). Nothing here runs while nothing is asked or nothing stalls.
"""
