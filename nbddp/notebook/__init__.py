"""The IPython face: ``%%ddp``, ``%ddp_session`` and the cell analysis; the only modules that
import IPython.core."""
