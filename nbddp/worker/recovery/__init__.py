"""Stopping well, the rank's half: ``nbddp.stopping()`` and the agreement on one step
(``stopping``), ``nbddp.checkpoint``/``restore`` with DCP (``checkpoints``) and what each object
saves (``state_dicts``), and the same stop under torchrun, where no kernel asks
(``standalone``). The kernel's half is ``nbddp/recovery.py`` and ``nbddp/rules/graceful.py``.
"""
