"""A notebook function keeps its cell's frames on a rank under every supported cloudpickle
(cloudpickle 3.1.3 names all shipped code ``<dynamic-code>``: ``wire/code_origin.py``).

Each supported release is installed into a folder of its own (cached in the venv) and put first
on a fresh interpreter's path; the function is pickled there with nbddp's pickler, as the kernel
does, and loaded in another fresh interpreter with the cell's sources, as a rank does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

# The floor pyproject.toml declares, the last release before the rename, and the newest.
VERSIONS = ["3.0.0", "3.1.2", "newest"]
CACHE = Path(sys.prefix) / "nbddp-test-cloudpickle"

CELL = """\
import warnings

def train(x):
    y = helper(x)
    return y

def helper(x):
    warnings.warn("slow step")
    return (lambda v: v / 0)(x)

class Model:
    def forward(self):
        return inner()

def inner():
    import traceback
    return traceback.extract_stack()[-2]
"""
CELL_FILE = "/tmp/ipykernel_4242/1234567.py"  # as ipykernel names a cell's code

KERNEL_SIDE = f"""
import io, linecache, sys
linecache.cache[{CELL_FILE!r}] = (1, None, {CELL!r}.splitlines(True), {CELL_FILE!r})
namespace = {{"__name__": "__main__"}}
exec(compile({CELL!r}, {CELL_FILE!r}, "exec"), namespace)
import cloudpickle
from nbddp.wire.payload import TransferPickler, notebook_sources
stream = io.BytesIO()
TransferPickler(stream).dump((namespace["train"], namespace["Model"], notebook_sources()))
sys.stdout.buffer.write(stream.getvalue())
"""

RANK_SIDE = """
import inspect, json, pickle, sys, traceback, warnings
import cloudpickle
from nbddp.wire.payload import install_sources
train, Model, sources = pickle.loads(sys.stdin.buffer.read())
install_sources(sources)
seen = {"cloudpickle": cloudpickle.__version__}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        train(1)
    except ZeroDivisionError as exc:
        frames = traceback.extract_tb(exc.__traceback__)[1:]
        seen["frames"] = [(f.filename, f.lineno, f.name, f.line) for f in frames]
seen["warning"] = [caught[0].filename, caught[0].lineno]
seen["source"] = inspect.getsource(train)
seen["method_caller"] = list(Model().forward()[:3])
print(json.dumps(seen))
"""


def _cloudpickle(version: str) -> Path:
    """A folder holding only that cloudpickle release ("newest": asked of the index now)."""
    folder = CACHE / version
    if version != "newest" and (folder / "cloudpickle").is_dir():
        return folder
    spec = "cloudpickle" if version == "newest" else f"cloudpickle=={version}"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade"]
    done = subprocess.run(
        [*pip, "--target", str(folder), spec],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"could not install {spec} from the index:\n{done.stderr}"
    return folder


def _python(folder: Path, code: str, stdin: bytes = b"") -> bytes:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.getcwd()])}
    done = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


@pytest.mark.parametrize("version", VERSIONS)
def test_a_notebook_function_keeps_its_cell_frames_on_a_rank(version):
    folder = _cloudpickle(version)
    stream = _python(folder, KERNEL_SIDE)
    seen = json.loads(_python(folder, RANK_SIDE, stream))
    if version != "newest":
        assert seen["cloudpickle"] == version
    assert seen["frames"] == [
        [CELL_FILE, 4, "train", "y = helper(x)"],
        [CELL_FILE, 9, "helper", "return (lambda v: v / 0)(x)"],
        [CELL_FILE, 9, "<lambda>", "return (lambda v: v / 0)(x)"],
    ]
    assert seen["warning"] == [CELL_FILE, 8]
    assert seen["source"] == "def train(x):\n    y = helper(x)\n    return y\n"
    assert seen["method_caller"] == [CELL_FILE, 13, "forward"]
