"""The worker side: what runs inside each rank (and in the kernel for the one-rank fallback).

Nothing here imports IPython or ipywidgets.
"""
