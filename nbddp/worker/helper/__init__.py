"""The pre-warmed helper's process and what it forks: never a rank's code.

Rules that hold here and nowhere else: never touch CUDA, and start no thread before a fork
(``preload`` checks every module it imports ahead of the ranks). ``server`` is the helper's
loop (``python -m nbddp.worker.helper.server``), ``forked`` a child from the fork to a rank,
``leaving`` a detached run's supervisor leaving the helper's tree, and ``own_helper`` the
helper that supervisor forks for its own ranks. The kernel's handle on it is
``nbddp/local/helper.py``.
"""
