"""Ranks on a Slurm allocation: the one this kernel runs in (``cluster="slurm"``) or one asked
for (:class:`~nbddp.clusters.slurm.allocation.SlurmCluster`), a warm node helper per node
started through ``srun``, connected back to the kernel over TCP.
"""
