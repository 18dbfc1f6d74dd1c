"""Ranks on a cluster engine: one folder per engine, each reusing ``local``'s rank group on its
nodes."""
