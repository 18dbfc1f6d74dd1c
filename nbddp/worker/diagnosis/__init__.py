"""What a rank says of itself when the kernel asks or judges: its threads' stacks and the
collective it is in (``stacks``), the collectives a session's rank issued per group
(``collectives``), and what it knows of "did DDP happen?" (``sync_check``)."""
