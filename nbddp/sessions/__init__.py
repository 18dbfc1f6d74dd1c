"""Ranks that stay up between cells: the ``Session`` handle, its ranks' life, one task at a time."""
