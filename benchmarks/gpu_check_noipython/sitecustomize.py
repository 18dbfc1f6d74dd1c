"""The GPU check's CPU rehearsal hides IPython and the kernel packages, as the device machine
has none (``gpu_check.py --cpu-rehearsal`` puts this folder first on ``PYTHONPATH``)."""

import sys


class _Hidden:
    names = ("IPython", "ipywidgets", "ipykernel", "jupyter_client", "comm")

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the rehearsal)")


sys.meta_path.insert(0, _Hidden())
