"""Other people's libraries on a rank, with no change to the user's code: what tqdm, the HF
Trainer, Lightning and Accelerate log or stop through (``integrations``, ``trainers``),
Catalyst's engines as one DDP job (``catalyst_engines``), and launchers started inside a rank
refused (``launchers``)."""
