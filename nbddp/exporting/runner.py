"""The part every exported script shares (``nbddp.export``, ``%%ddp --export``): join the
process group torchrun set up, load what the notebook captured, run the function or the cell
on this rank as ``notebook_launch`` would, and keep rank 0's value.

This file is copied whole into each exported script, which must run where nbddp's kernel side
is absent: it imports only the standard library, torch and cloudpickle, never nbddp. Its one
top-level name is :class:`NbddpScript` (a cell's own names share the script's namespace).

Where nbddp is importable, a graceful stop works here too: ``nbddp.checkpoint`` saves into
the checkpoint directory the notebook's launch used (``NBDDP_CHECKPOINT_DIR`` overrides it),
and SIGTERM or the batch file's stop file (Slurm's signal before the time limit) stops every
rank at the same step (``nbddp/worker/recovery/standalone.py``); when it did, rank 0 leaves
``$NBDDP_STOP_FILE.stopped`` for the batch file, which then requeues the job to resume.

Non-goals: supervising the ranks (torchrun does: a failing rank ends the job, and its
traceback heads torchrun's summary, and ``--max-restarts`` restarts them) and the live panel
(``nbddp.log`` does nothing outside a launch).
"""

from typing import Any


class NbddpScript:
    """One rank of an exported script. ``export`` is the literal the exporter wrote: what was
    exported (``kind``: "function" or "cell"), the payload's file, device and backend, and
    what the payload needs to unpickle."""

    def __init__(self, export: dict[str, Any], script: str, module: str) -> None:
        import os

        self.export = export
        self.module = module  # the script's __name__: "__main__" when run, not imported
        self.script = os.path.abspath(script)
        self.here = os.path.dirname(self.script)
        self.name = os.path.basename(self.script)
        self.result: str | None = os.path.join(self.here, export["result"])
        self.rank = 0
        self.watcher: Any = None  # nbddp's watch for a graceful stop, where nbddp is installed

    # -- the two kinds ---------------------------------------------------------------------

    def run_function(self) -> None:
        """``fn(*args, **kwargs)`` on this rank; rank 0's return value is kept."""
        self._start()
        fn, args, kwargs = self._load()["call"]
        value = fn(*args, **kwargs)
        self._keep(value)
        self._end()

    def start_cell(self) -> dict[str, Any]:
        """Before the cell: join the process group; the notebook's names the cell reads."""
        self._start()
        inputs: dict[str, Any] = self._load()["inputs"]
        return inputs

    def show(self, value: Any) -> None:
        """The cell's last expression, which the notebook shows: printed by rank 0."""
        if value is not None and self.rank == 0:
            print(repr(value), flush=True)

    def finish_cell(self, namespace: dict[str, Any]) -> None:
        """After the cell: rank 0 keeps the names it assigned (those ``%%ddp`` brings back)."""
        values = {}
        for name in self.export["out_names"]:
            if name in namespace:
                values[name] = namespace[name]
        self._keep(values, skip_unpicklable=True)
        self._end()

    # -- setting up --------------------------------------------------------------------------

    def _start(self) -> None:
        import sys

        if self.module != "__main__" and self.export["kind"] == "cell":
            raise ImportError(
                f"{self.name} runs a notebook cell at its top level: run it as a script "
                f"(torchrun --nproc-per-node N {self.name}), do not import it."
            )
        self._arguments(sys.argv[1:])
        sys.excepthook = self._recording(sys.excepthook)
        self._adopt_paths()
        self._check_needs()
        self._join()
        self._watch_for_a_stop()

    def _arguments(self, argv: list[str]) -> None:
        import argparse

        parser = argparse.ArgumentParser(
            prog=self.name,
            description=f"Run {self.export['what']} on every rank torchrun starts "
            f"(torchrun --nproc-per-node N {self.name}); rank 0's value is saved.",
        )
        parser.add_argument(
            "--result", default=self.result, help="where rank 0 saves its value (cloudpickle)"
        )
        parser.add_argument("--no-result", action="store_true", help="save nothing")
        options = parser.parse_args(argv)
        self.result = None if options.no_result else options.result

    def _check_needs(self) -> None:
        """Say which modules the payload needs and this Python lacks, before unpickling."""
        import importlib

        missing = []
        for module, origin in self.export["needs"].items():
            try:
                importlib.import_module(module)  # unpickling imports it anyway
            except Exception:
                missing.append(f"{module} ({origin})")
        if missing:
            raise SystemExit(
                f"{self.name}: the exported data needs modules this Python cannot import: "
                f"{', '.join(missing)}. Install them (pip install ...), or put local modules "
                "beside this script or on PYTHONPATH."
            )

    def _adopt_paths(self) -> None:
        """The notebook's own module directories (not its environment's site-packages), so
        what it imported from them imports here too when the files are reachable."""
        import os
        import sys

        for entry in self.export["paths"]:
            if os.path.isdir(entry) and entry not in sys.path:
                sys.path.append(entry)

    def _join(self) -> None:
        import os

        import torch
        import torch.distributed as dist

        env = os.environ
        if "RANK" not in env:  # ``python script.py``: one rank, like num_workers=1
            env.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self._free_port()),
            )
        self.rank = int(env["RANK"])
        local_rank = int(env["LOCAL_RANK"])
        self.device = torch.device("cpu")
        if self.export["device"] == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit(
                    f"{self.name} was exported for GPUs (device='cuda') but this machine "
                    "has none. Run it where there are GPUs, or export again with device='cpu'."
                )
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        if int(env["WORLD_SIZE"]) > int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])):
            self._pick_interface()
        # no rank leaves the joining before every rank joined (torch's store barrier): else a
        # rank that finishes first, and exits, can close a connection that a slower rank's gloo
        # is still setting up ("Connection closed by peer" in connectFullMesh, seen under load
        # for a function with no collective); a value the user set is kept
        env.setdefault("TORCH_DIST_INIT_BARRIER", "1")
        dist.init_process_group(self.export["backend"])
        self._accept_own_init(dist)

    def _watch_for_a_stop(self) -> None:
        """The notebook's checkpoint directory, and a graceful stop on SIGTERM or the stop
        file, where nbddp is installed (a function that calls nbddp needs it anyway)."""
        import atexit
        import os

        os.environ.setdefault("NBDDP_CHECKPOINT_DIR", self.export.get("checkpoint_dir", ""))
        os.environ.setdefault("NBDDP_CHECKPOINT_KEEP", str(self.export.get("keep", 2)))
        try:
            from nbddp.worker.recovery import standalone
        except ImportError:
            return
        self.watcher = standalone.install()
        if self.watcher is not None:  # ended by _end, or here when the function raised
            atexit.register(self.watcher.close)

    def _pick_interface(self) -> None:
        """Across nodes, gloo and NCCL use the interface that reaches MASTER_ADDR, unless
        told otherwise: left alone they take the hostname's address, which is 127.0.1.1 on
        many machines, and the ranks never meet."""
        import fcntl
        import os
        import socket
        import struct

        if "GLOO_SOCKET_IFNAME" in os.environ or "NCCL_SOCKET_IFNAME" in os.environ:
            return
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
                address = probe.getsockname()[0]
        except OSError:
            return
        if address.startswith("127."):
            return
        for _, interface in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                request = struct.pack("256s", interface.encode()[:15])
                try:
                    reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(reply[20:24]) == address:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
                os.environ["NCCL_SOCKET_IFNAME"] = interface
                return

    @staticmethod
    def _accept_own_init(dist: Any) -> None:
        """The function's own ``init_process_group`` (as in the tutorials) returns when it
        asks for the world this script joined, as it does under ``notebook_launch``."""
        original = dist.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if not dist.is_initialized():
                original(*args, **kwargs)
                return
            rank, size = kwargs.get("rank", -1), kwargs.get("world_size", -1)
            if rank not in (-1, dist.get_rank()) or size not in (-1, dist.get_world_size()):
                raise RuntimeError(
                    f"init_process_group(rank={rank}, world_size={size}): this script already "
                    f"joined the process group as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}; the ranks come from torchrun's "
                    "--nnodes and --nproc-per-node."
                )

        dist.init_process_group = init_process_group

    @staticmethod
    def _free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port

    def _load(self) -> dict[str, Any]:
        """The payload: tensors that were on the notebook's GPU arrive on this rank's."""
        import linecache
        import os
        import pickle

        device = self.device

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                kind, value = pid
                if kind != "on-device":
                    raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
                return value.to(device)

        with open(os.path.join(self.here, self.export["payload"]), "rb") as f:
            payload: dict[str, Any] = Unpickler(f).load()
        linecache.cache.update(payload.get("sources", {}))  # notebook lines in tracebacks
        return payload

    # -- ending ------------------------------------------------------------------------------

    def _keep(self, value: Any, skip_unpicklable: bool = False) -> None:
        """Rank 0 saves its value (tensors on the CPU, DDP unwrapped), atomically."""
        import io
        import os
        import reprlib
        import sys

        if self.rank != 0 or self.result is None:
            return
        if skip_unpicklable:
            for name in list(value):
                try:
                    self._pickle(io.BytesIO(), value[name])
                except Exception as exc:
                    print(
                        f"{self.name}: {name} is not saved: it cannot be pickled "
                        f"({type(exc).__name__}: {exc})",
                        file=sys.stderr,
                    )
                    del value[name]
        partial = f"{self.result}.{os.getpid()}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner-only
        with open(fd, "wb") as f:
            self._pickle(f, value)
        os.replace(partial, self.result)
        shown = reprlib.repr(value)
        print(f"{self.name}: rank 0's value {shown} is saved in {self.result}", file=sys.stderr)

    @staticmethod
    def _pickle(file: Any, value: Any) -> None:
        import operator

        import cloudpickle
        import torch

        class ResultPickler(cloudpickle.Pickler):  # type: ignore[misc]
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                    return operator.getitem, ([obj.module], 0)
                if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                    cpu = obj.detach().cpu()
                    if isinstance(obj, torch.nn.Parameter):
                        cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
                    elif cpu.is_floating_point():
                        cpu.requires_grad_(obj.requires_grad)
                    return cpu.__reduce_ex__(5)  # type: ignore[no-untyped-call]
                return super().reducer_override(obj)

        ResultPickler(file, protocol=5).dump(value)

    def _end(self) -> None:
        import os

        import torch.distributed as dist

        stop_file = os.environ.get("NBDDP_STOP_FILE")
        if self.watcher is not None:
            self.watcher.close()
        if self.rank == 0 and stop_file and self.watcher and self.watcher.agreement.landed:
            with open(stop_file + ".stopped", "w") as f:  # the batch file requeues the job
                f.write("stopped at a step boundary before the end\n")
        if dist.is_initialized():
            dist.destroy_process_group()
        self._let_gloo_settle()

    @staticmethod
    def _let_gloo_settle(limit: float = 2.0) -> None:
        """Return once gloo's worker threads are all asleep (at most ``limit`` seconds).

        An allreduce DDP starts in backward carries autograd's context, a Python object, and
        gloo's worker thread frees it after the work is done, taking the GIL. A worker that
        asks for the GIL as the interpreter finalizes is unwound out of C++ and the rank
        aborts ('terminate called without an active exception', SIGABRT) after its value was
        saved, so torchrun reports the run failed: 6 times in 700 runs of the docs' export
        block, four at once on two cores. Plain DDP scripts share the race, and
        ``destroy_process_group`` does not end it: once DDP used the group, torch keeps the
        group and its threads alive.

        Sleeping releases the GIL, so a worker waiting for it gets it; a worker that is
        running shows as such in ``/proc``. Two looks a sleep apart that find every worker
        asleep (waiting for work) mean none can ask for the GIL again. Where there is no
        ``/proc`` (not Linux) or no gloo worker, this returns at once. Not covered: a worker
        still inside a collective nobody waited for (it sleeps on the network)."""
        import os
        import time

        tasks = "/proc/self/task"
        if not os.path.isdir(tasks):
            return
        deadline = time.monotonic() + limit
        quiet = 0
        while quiet < 2 and time.monotonic() < deadline:
            states = []
            for tid in os.listdir(tasks):
                try:
                    with open(f"{tasks}/{tid}/comm") as f:
                        if f.read().strip() != "pt_gloo_runloop":
                            continue
                    with open(f"{tasks}/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except OSError:  # the thread is gone
                    continue
            if not states:
                return
            quiet = quiet + 1 if all(state == "S" for state in states) else 0
            time.sleep(0.01)

    @staticmethod
    def _recording(hook: Any) -> Any:
        """The rank's exception reaches torchrun's error file (what ``@record`` does): its
        summary then shows the failing rank's traceback, not only its exit code."""

        import os

        def record(kind: Any, error: BaseException, traceback: Any) -> None:
            if isinstance(error, Exception) and "TORCHELASTIC_ERROR_FILE" in os.environ:
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                handler = get_error_handler()
                handler.initialize()
                handler.record_exception(error)
            hook(kind, error, traceback)

        return record
