"""What decides a run from its ranks' events: the rules, not the mechanism (no sockets, no
processes)."""
