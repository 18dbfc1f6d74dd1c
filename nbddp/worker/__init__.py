"""The worker side: everything that runs outside the kernel's own code path, in the processes
that carry a run's ranks. It imports only ``worker/``, ``wire/`` and ``errors/``, never IPython
or ipywidgets (``tests/test_architecture.py`` holds both).

Which process runs which folder:

============================  ==================================================================
folder                        runs in
============================  ==================================================================
``context``, ``live``,        a rank, and the kernel for a one-rank run: what user code calls
``prepare``, ``progress``     (``nbddp.rank()``, ``log``, ``prepare_model``, ``progress``)
``reaping``                   any process of ours that must end its descendants (a rank, the
                              helper)
``rank/``                     a rank's own process, launched or in a session, from its spec to
                              ``os._exit``; its runtime (``rank/runtime.py``) is also what the
                              kernel installs for its one-rank run
``helper/``                   the pre-warmed helper, its forked children before they become
                              ranks, and a detached run's supervisor as it leaves
``recovery/``                 a rank (stopping well), and a torchrun rank of an exported script
``debugging/``                a rank, and the kernel for a one-rank run (pdb, ``input()``)
``output/``                   a rank (rich output and figures sent to the cell)
``diagnosis/``                a rank (its roll-call answers, collectives, "did DDP happen?")
``libraries/``                a rank (tqdm, the HF Trainer, Lightning, Accelerate, Catalyst)
============================  ==================================================================

Every module a rank imports before ``fn`` is also imported by the pre-warmed helper ahead of
the fork (``helper/server.py``), so it must be fork-safe on import: no thread, no CUDA.
"""

import os

# nbddp's own directory, with a trailing separator: frames and modules under it are ours, left
# out of a user's traceback, a roll-call's "where in your code" and pdb's stack.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
