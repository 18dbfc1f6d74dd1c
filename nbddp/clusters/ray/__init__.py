"""Ranks on a Ray cluster: where they fit, a warm helper actor per node, the kernel polling them.

Named after the engine, as submitit names its executors; inside, ``import ray`` is Ray itself.
"""
