"""pdb and ``input()`` on a rank, answered in the notebook's input box: the hooks
(``debugger``: ``breakpoint()``, ``nbddp.breakpoint``, post-mortem), pdb on the wire
(``rank_pdb``, imported on a rank's first stop) and the questions sent to the kernel, with the
ranks held at ``nbddp.breakpoint()`` (``asking``).
"""
