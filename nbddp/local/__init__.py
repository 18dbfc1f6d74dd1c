"""Ranks on this machine: started by the pre-warmed helper (or cold), watched by one loop, torn
down.

The in-kernel world of one rank lives here too. Nothing here knows about clusters or sessions.
"""
