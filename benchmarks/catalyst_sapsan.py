"""Sapsan's CNN example (Catalyst 21.x) in a real kernel: once in one process, then unchanged
but for ``ddp=True`` in a ``%%ddp -n 2 --device cpu`` cell (issue #23). Prints what happened:
the engine Catalyst chose, whether both ranks hold the same weights, how many batches each
rank trained on, the final losses, and what came back into the notebook.

Sapsan cannot share the dev environment (it pins ``catalyst<=21.12``, which cannot sit beside
the 22.x the tests use, and ``numpy<2.4`` for its tensorboardX), so this runs in a venv of
its own, e.g.::

    python -m venv /tmp/sapsan && /tmp/sapsan/bin/pip install -e . ipykernel
    /tmp/sapsan/bin/pip install --no-deps --ignore-requires-python sapsan==0.6.5 \\
        "catalyst==21.12" "tensorboardX==2.2" "hydra-slayer==0.5.0" "numpy<2.4"
    /tmp/sapsan/bin/pip install scipy h5py matplotlib "protobuf==3.20.*" scikit-learn \\
        scikit-image plotly pandas safitty
    /tmp/sapsan/bin/python benchmarks/catalyst_sapsan.py

(``--ignore-requires-python``: Sapsan says ``<3.11``; ``--no-deps``: a current pip ignores
Catalyst 21.6-21.12's metadata and would pick 21.5.) The HDF5 file is the one Sapsan's wheel
ships for this example.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

EXAMPLE = """
from sapsan.lib.backends import FakeBackend
from sapsan.lib.data import HDF5Dataset, EquidistantSampling, flatten
from sapsan.lib.estimator.cnn.cnn3d_estimator import CNN3d, CNN3dConfig
from sapsan.lib import Train

path = "data/cnn_krr/t{checkpoint:1.0f}/{feature}_dim32_fm15.h5"
features = ['u']
target   = ['u']
INPUT_SIZE = [32,32,32]
SAMPLE_TO = [16,16,16]
sampler = EquidistantSampling(SAMPLE_TO)
data_loader = HDF5Dataset(path = path, features = features, target = target, checkpoints = [0],
                          input_size = INPUT_SIZE, sampler = sampler, shuffle = False,
                          train_fraction = 1)
x, y = data_loader.load_numpy()
y    = flatten(y)
loaders = data_loader.convert_to_torch([x, y])
estimator = CNN3d(config  = CNN3dConfig(n_epochs = 5, patience = 10, min_delta = 1e-5{ddp}),
                  loaders = loaders)
training_experiment = Train(model = estimator, backend = FakeBackend(),
                            data_parameters = data_loader)
estimator = training_experiment.run()
"""

CHECKS = """
import torch, torch.distributed as dist, nbddp
model = estimator.model
metrics = estimator.metrics()
engine = type(estimator.runner.engine).__name__
batches = len(estimator.runner.loaders['train'])
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.zeros_like(flat) for _ in range(nbddp.world_size())]
dist.all_gather(every, flat)
same_weights = all(bool((w == every[0]).all()) for w in every)
del every, flat, estimator, training_experiment, data_loader, loaders, x, y, sampler
"""


def main() -> int:
    try:
        import catalyst
        import sapsan
        from jupyter_client.manager import KernelManager
    except ImportError as exc:
        print(f"not run: {exc} (see this script's docstring for the venv it needs)")
        return 2
    print(f"Python {sys.version.split()[0]}, Catalyst {catalyst.__version__}")
    data = os.path.join(os.path.dirname(sapsan.__file__), "examples", "data", "cnn_krr")
    work = tempfile.mkdtemp(prefix="sapsan-")
    shutil.copytree(data, os.path.join(work, "data", "cnn_krr"))
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=work)
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)

    def run(code: str) -> str:
        chunks: list[str] = []

        def collect(msg: dict) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                chunks.append(content["text"])
            elif msg["msg_type"] in ("execute_result", "display_data"):
                chunks.append(content["data"].get("text/plain", "") + "\n")
            elif msg["msg_type"] == "error":
                chunks.append("\n".join(content["traceback"]))

        start = time.perf_counter()
        reply = client.execute_interactive(code, timeout=900, output_hook=collect)
        took = time.perf_counter() - start
        status = reply["content"]["status"]
        return f"[{status}, {took:.1f} s]\n" + "".join(chunks)

    try:
        run("%load_ext nbddp\nimport warnings; warnings.simplefilter('default')")
        print("== one process (ddp=False) ==")
        out = run(EXAMPLE.replace("{ddp}", ""))
        print(out[-1500:])
        print(
            run(
                "print('single-process final loss:', estimator.metrics()['train']['loss'], "
                "'| batches:', len(estimator.runner.loaders['train']), "
                "'| samples:', len(estimator.runner.loaders['train'].dataset))"
            )
        )
        print("== %%ddp -n 2 --device cpu, ddp=True ==")
        cell = EXAMPLE.replace("{ddp}", ", ddp=True").lstrip("\n") + CHECKS
        out = run("%%ddp -n 2 --device cpu --display text\n" + cell)
        print(out[-4000:])
        print(
            run(
                "print('engine:', engine, '| same weights on both ranks:', same_weights, "
                "'| batches per rank:', batches)\n"
                "print('final loss (rank 0):', metrics['train']['loss'])\n"
                "print('model back in the notebook:', type(model).__name__, "
                "sum(p.numel() for p in model.parameters()), 'parameters')\n"
                "print('verdict:', nbddp.last_run().warning)"
            )
        )
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
