"""``nbddp.export`` and ``%%ddp --export``: the script torchrun runs gives what
``notebook_launch`` gave, from a real notebook kernel; what cannot be exported is named before
any file is written; the script needs neither nbddp nor the notebook to run."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import nbddp
from nbddp.exporting import pickling

PYTHON = sys.executable


def torchrun(script: Path, *args: str, ranks: int = 2, env: dict | None = None):
    """``torchrun --standalone --nproc-per-node N script``, as a user would type it."""
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run(
        [*command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        cwd=script.parent,
    )


# -- the round trips, from a real kernel ------------------------------------------------------


@pytest.fixture(scope="module")
def notebook(kernel_factory, tmp_path_factory):
    kernel = kernel_factory()
    folder = tmp_path_factory.mktemp("exported")
    out, reply = kernel.run(
        f"import pickle, subprocess, sys, torch, nbddp\n"
        f"import torch.distributed as dist\n"
        f"%load_ext nbddp\n"
        f"FOLDER = {str(folder)!r}\n"
        "def torchrun(script):\n"
        "    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run',\n"
        "                           '--standalone', '--nproc-per-node=2', script],\n"
        "                          capture_output=True, text=True, timeout=180)\n"
        "    assert done.returncode == 0, done.stdout + done.stderr\n"
        "    with open(script[:-3] + '.result.pkl', 'rb') as f:\n"
        "        return pickle.load(f), done\n"
        "class Summary:\n"
        "    def __init__(self, total, ranks):\n"
        "        self.total, self.ranks = total, ranks\n"
        "    def __eq__(self, other):\n"
        "        return (type(other) is Summary and torch.equal(self.total, other.total)\n"
        "                and self.ranks == other.ranks)\n"
    )
    assert reply["status"] == "ok", out
    yield kernel
    kernel.shutdown()


@pytest.mark.e2e
def test_a_function_with_captured_tensors_and_a_notebook_class(notebook):
    out, reply = notebook.run(
        textwrap.dedent(
            """
            weights = torch.linspace(0, 1, 5)
            table = {"bias": torch.ones(5)}

            def train(scale, shift=0.0):
                t = weights * scale + table["bias"] * nbddp.rank() + shift
                dist.all_reduce(t)
                return Summary(t, [nbddp.rank(), nbddp.world_size()])

            launched = nbddp.notebook_launch(train, (2.0,), {"shift": 1.0}, num_workers=2,
                                             device="cpu", display="none")
            paths = nbddp.export(train, FOLDER + "/train.py", (2.0,), {"shift": 1.0},
                                 num_workers=2, device="cpu")
            exported, done = torchrun(paths[0])
            print([p.rsplit("/", 1)[1] for p in paths])
            print(exported == launched, type(exported) is Summary, exported.ranks)
            """
        )
    )
    assert reply["status"] == "ok", out
    assert out.splitlines() == ["['train.py', 'train.pkl', 'train.sbatch']", "True True [0, 2]"]


@pytest.mark.e2e
def test_a_ddp_cell_gives_the_names_the_notebook_gets(notebook):
    cell = textwrap.dedent(
        """
        model = torch.nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.zero_()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        grads = []
        for x in batches:
            ddp(x + nbddp.rank()).sum().backward()
            grads.append(model.weight.grad.clone())
        summary = Summary(torch.stack(grads), [nbddp.world_size()])
        total = float(model.weight.grad.sum())
        total * 2
        """
    )
    notebook.run("batches = [torch.ones(4, 3), torch.full((4, 3), 2.0)]")
    out, reply = notebook.run("%%ddp -n 2 --device cpu --display none" + cell)
    assert reply["status"] == "ok", out
    assert out.strip() == "96.0"  # the cell's last value, shown
    out, reply = notebook.run("%%ddp --export {FOLDER}/cell.py -n 2 --device cpu" + cell)
    assert reply["status"] == "ok", out
    assert "cell.py" in out and "torchrun --standalone --nproc-per-node 2 cell.py" in out
    out, reply = notebook.run(
        "exported, done = torchrun(FOLDER + '/cell.py')\n"
        "print(sorted(exported))\n"
        "model_back = exported['model']\n"
        "print(exported['summary'] == summary, exported['total'] == total,\n"
        "      type(model_back).__name__, torch.equal(model_back.weight, model.weight))\n"
        "print(done.stdout.strip().splitlines()[-1])\n"
    )
    assert reply["status"] == "ok", out
    assert out.splitlines() == [
        "['ddp', 'grads', 'model', 'summary', 'total', 'x']",
        "True True Linear True",  # DDP wrappers unwrapped, as %%ddp brings them back
        "96.0",  # the last expression, printed by rank 0
    ]
    script = Path(notebook.run("print(FOLDER)")[0].strip()) / "cell.py"
    text = script.read_text()
    assert "model = torch.nn.Linear(3, 1)" in text and "_nbddp.show(total * 2)" in text


@pytest.mark.e2e
def test_export_refuses_a_session_cell(notebook):
    out, reply = notebook.run("%%ddp --export {FOLDER}/never.py --session\nx = 1")
    assert reply["status"] == "error" and "--session" in out
    out, reply = notebook.run("%%ddp --export {FOLDER}/never -n 2 --device cpu\nx = 1")
    assert reply["status"] == "error" and "suffix .py" in out
    assert notebook.run("import os; print(sorted(os.listdir(FOLDER)))")[0].count("never") == 0


# -- in this process: this module's functions travel by value, as a notebook's do -----------


@pytest.fixture(autouse=True, scope="module")
def by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


data = None  # set by the tests: a global the exported functions capture


def adds(offset: float) -> list:
    import torch.distributed as dist

    return [dist.get_rank(), dist.get_world_size(), float(data.sum()) + offset]


@pytest.mark.ranks
def test_python_alone_runs_one_rank_and_keeps_its_value(tmp_path):
    import torch

    global data
    data = torch.arange(4.0)
    script = Path(nbddp.export(adds, tmp_path / "one.py", (0.5,), device="cpu")[0])
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import pickle

    assert pickle.loads((tmp_path / "one.result.pkl").read_bytes()) == [0, 1, 6.5]
    assert "rank 0's value [0, 1, 6.5] is saved in" in done.stderr
    done = subprocess.run(
        [PYTHON, str(script), "--result", str(tmp_path / "elsewhere.pkl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and (tmp_path / "elsewhere.pkl").exists()


def init_barrier() -> str | None:
    import os

    return os.environ.get("TORCH_DIST_INIT_BARRIER")


@pytest.mark.ranks
def test_no_rank_leaves_the_joining_before_every_rank_joined(tmp_path):
    """The script turns on torch's barrier after ``init_process_group``: without it a rank
    that finished first could exit while a slower one's gloo was still connecting to it, and
    that rank failed ("Connection closed by peer", once in a full run under load). A value
    the user set is kept."""
    script = Path(nbddp.export(init_barrier, tmp_path / "join.py", device="cpu")[0])
    result = tmp_path / "join.result.pkl"
    for asked, seen in ((None, "1"), ("0", "0")):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_DIST_INIT_BARRIER"}
        if asked is not None:
            env["TORCH_DIST_INIT_BARRIER"] = asked
        done = subprocess.run(
            [PYTHON, str(script)], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 0, done.stderr
        assert pickle.loads(result.read_bytes()) == seen


@pytest.mark.e2e
def test_the_script_needs_no_nbddp_unless_the_function_calls_it(tmp_path):
    """A directory first on the path whose ``nbddp`` cannot be imported: the script of a
    function that never calls nbddp still runs; one that does says what it needs."""
    import torch

    global data
    data = torch.ones(3)
    blocker = tmp_path / "blocker" / "nbddp"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('nbddp is not installed here')\n")
    plain = Path(nbddp.export(adds, tmp_path / "plain.py", (1.0,), num_workers=2)[0])
    assert "nbddp" not in pickling.modules_needed((tmp_path / "plain.pkl").read_bytes())
    done = torchrun(plain, env={"PYTHONPATH": str(blocker.parent)})
    assert done.returncode == 0, done.stderr
    import pickle

    assert pickle.loads((tmp_path / "plain.result.pkl").read_bytes()) == [0, 2, 4.0]

    uses = Path(nbddp.export(lambda: nbddp.rank(), tmp_path / "uses.py", num_workers=1)[0])
    done = subprocess.run(
        [PYTHON, str(uses)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(blocker.parent)},
    )
    assert done.returncode == 1
    assert "needs modules this Python cannot import: nbddp (" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.ranks
def test_a_local_module_the_payload_needs_is_named_when_missing(tmp_path, monkeypatch):
    (tmp_path / "helpers_for_export.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import helpers_for_export

    script = tmp_path / "out" / "local.py"
    script.parent.mkdir()
    nbddp.export(lambda: helpers_for_export.double(21), script, num_workers=1)
    text = script.read_text()
    assert "helpers_for_export (a local module, " in text
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # the notebook's own directories are searched
    (tmp_path / "helpers_for_export.py").unlink()
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "cannot import: helpers_for_export (a local module, " in done.stderr
    sys.modules.pop("helpers_for_export", None)


@pytest.mark.e2e
def test_a_failing_rank_fails_the_script_with_its_traceback(tmp_path):
    def fails():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        dist.barrier()

    script = Path(nbddp.export(fails, tmp_path / "fails.py", num_workers=2, device="cpu")[0])
    done = torchrun(script)
    assert done.returncode != 0
    assert "ValueError: rank 1 gives up" in done.stderr + done.stdout
    assert not (tmp_path / "fails.result.pkl").exists()


lock = threading.Lock()


def holds_a_lock() -> None:
    with lock:
        pass


@pytest.mark.unit
def test_what_cannot_be_exported_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(nbddp.SerializationError) as caught:
        nbddp.export(holds_a_lock, tmp_path / "train.py")
    assert "holds_a_lock -> global 'lock' -> " in str(caught.value)
    assert "train.py" in str(caught.value)
    with pytest.raises(nbddp.SerializationError, match=r"args\[0\]"):
        nbddp.export(adds, tmp_path / "train.py", (threading.Lock(),))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    ("path", "options", "message"),
    [
        ("train", {}, "suffix .py"),
        ("missing/train.py", {}, "does not exist"),
        ("train.py", {"num_workers": 3, "nodes": 2}, "do not split evenly"),
        ("train.py", {"num_workers": 0}, "int >= 1"),
        ("train.py", {"nodes": 0}, "nodes=0"),
        ("train.py", {"device": "tpu"}, "device='tpu'"),
        ("train.py", {"device": "cuda"}, "pass num_workers="),
        ("train.py", {"sbatch": "yes"}, "sbatch="),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, path, options, message):
    import torch

    if options.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is visible: num_workers='auto' counts it")
    with pytest.raises(ValueError, match=message):
        nbddp.export(adds, tmp_path / path, (1.0,), **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_the_batch_file_for_a_gpu_allocation_asks_for_its_gpus_and_nodes_and_is_valid_bash(
    tmp_path,
):
    """Its text only: no GPU allocation here. The batch file running on two real Slurm
    nodes (CPU) is ``tests/clusters/test_slurm.py``."""
    written = nbddp.export(adds, tmp_path / "big.py", (1.0,), num_workers=8, device="cuda", nodes=2)
    batch = Path(written[2])
    text = batch.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "srun --kill-on-bad-exit=1 ",
        '--nnodes=2 --node-rank="$SLURM_NODEID" --nproc-per-node=4',
        f"PYTHON=${{NBDDP_PYTHON:-{sys.executable}}}",
    ):
        assert line in text
    assert subprocess.run(["bash", "-n", str(batch)]).returncode == 0
    assert "'backend': 'nccl'" in Path(written[0]).read_text()
    assert nbddp.export(adds, tmp_path / "no_batch.py", (1.0,), sbatch=False)[1:] == [
        str(tmp_path / "no_batch.pkl")
    ]


@pytest.mark.ranks  # it runs the script: the GPU check found it marked unit
@pytest.mark.gpu
def test_a_tensor_on_the_notebooks_gpu_arrives_on_each_ranks_gpu(tmp_path):
    import torch

    global data
    data = torch.arange(4.0, device="cuda")

    def where() -> list:
        return [str(data.device), float(data.sum())]

    script = Path(nbddp.export(where, tmp_path / "gpu.py", num_workers=1, device="cuda")[0])
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import pickle

    assert pickle.loads((tmp_path / "gpu.result.pkl").read_bytes()) == ["cuda:0", 6.0]


def inits_its_own_group(world: int) -> list:
    """As the PyTorch tutorials do: set the rendezvous, then ask for the process group."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", "12355"
    dist.init_process_group("gloo", rank=0, world_size=world)
    return [dist.get_rank(), dist.get_world_size()]


@pytest.mark.ranks
@pytest.mark.xdist_group("port-12355")  # the tutorials' MASTER_PORT, as test_tutorials' tests
def test_the_functions_own_init_process_group_joins_the_scripts_world(tmp_path):
    script = Path(nbddp.export(inits_its_own_group, tmp_path / "own.py", (1,), device="cpu")[0])
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import pickle

    assert pickle.loads((tmp_path / "own.result.pkl").read_bytes()) == [0, 1]
    nbddp.export(inits_its_own_group, script, (4,), device="cpu")
    done = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "already joined the process group as rank 0 of 1" in done.stderr


@pytest.mark.unit
def test_cluster_slurm_outside_an_allocation_says_how_to_run_on_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match=r"not in one.*nbddp\.SlurmCluster\(.*nbddp\.export\("):
        nbddp.notebook_launch(adds, (1.0,), cluster="slurm")
