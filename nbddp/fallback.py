"""One rank: run ``fn`` in the kernel itself, with the same API as a multi-rank launch.

No subprocess. For the length of the call the kernel looks like rank 0 of a world of 1: the
torchrun variables are set, a world-size-1 process group exists (unless the user already made
one), the runtime functions answer for the plan's device. All of it is undone afterwards.

Timeouts and ``Run.stop()`` interrupt the call by raising inside its thread between two Python
bytecodes; code blocked in one long native call is interrupted when it returns to Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import payload
from .errors import LaunchTimeout, WorkerError
from .plan import LaunchPlan
from .run import Run
from .worker import live
from .worker.context import Context, installed
from .worker.report import format_user_traceback
from .workers import free_port


class _Abort(BaseException):
    """Raised inside the fallback's thread by a timeout or ``Run.stop()``."""


@contextmanager
def single_rank_world(plan: LaunchPlan) -> Iterator[None]:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
    env = {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        **plan.env,
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    made_group = False
    previous_cuda = None
    try:
        if device.type == "cuda":
            previous_cuda = torch.cuda.current_device()
            torch.cuda.set_device(device)
        if dist.is_available() and not dist.is_initialized():
            dist.init_process_group(plan.backend, store=dist.HashStore(), rank=0, world_size=1)
            made_group = True
        with installed(Context(rank=0, local_rank=0, world_size=1, device=device)):
            yield
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()
        if previous_cuda is not None:
            torch.cuda.set_device(previous_cuda)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_in_kernel(fn: Callable[..., Any], args: tuple, kwargs: dict, plan: LaunchPlan) -> Any:
    """Blocking: return the value or raise. Non-blocking: return a running :class:`Run`."""
    __tracebackhide__ = True  # IPython: show the user's frames, not ours
    run = Run(plan, device_name=_device_name(plan))
    run._show(plan.display, blocking=plan.block)
    run.state.set_running()
    if not plan.block:
        thread = threading.Thread(
            target=_call, args=(fn, args, kwargs, plan, run), name="nbddp-fallback", daemon=True
        )
        thread.start()
        return run
    _call(fn, args, kwargs, plan, run)
    return run.result()


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict, plan: LaunchPlan, run: Run) -> None:
    thread_id = threading.get_ident()
    lock = threading.Lock()
    # Raise inside the thread only while fn itself runs, never inside our own setup/teardown.
    phase: dict[str, Any] = {"phase": "setup", "reason": None}

    def abort(reason: str) -> None:
        with lock:
            if phase["reason"] is not None or phase["phase"] == "returned":
                return
            phase["reason"] = reason
            if phase["phase"] == "calling":
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(thread_id), ctypes.py_object(_Abort)
                )

    run._stopper = lambda: abort("stopped")
    timer = threading.Timer(plan.timeout, abort, ("timeout",)) if plan.timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    state = run.state
    buffer = live.LiveBuffer(
        lambda kind, data: state.add_rows(0, *data) if kind == "log" else state.set_bars(data)
    )
    # A blocking call owns the cell: its prints go to the panel, like a worker's would.
    panel = plan.block and run._shows_panel
    redirect = _redirected(state.as_stream()) if panel else contextlib.nullcontext()
    previous_buffer = live.install(buffer)
    try:
        with single_rank_world(plan), redirect:
            with lock:
                if phase["reason"] is not None:
                    raise _Abort
                phase["phase"] = "calling"
            try:
                value = fn(*args, **kwargs)
            finally:
                with lock:
                    phase["phase"] = "returned"
                buffer.close()
        run._finish("succeeded", payload.to_cpu(value))
    except _Abort:
        if phase["reason"] == "timeout":
            run._finish("failed", error=LaunchTimeout(plan.timeout))
        else:
            run._finish("stopped")
    except KeyboardInterrupt:
        run._finish("stopped")
        raise
    except BaseException as exc:
        error = WorkerError(
            0, exc_type=type(exc).__name__, exc_message=str(exc),
            remote_traceback=format_user_traceback(exc),
        )
        error.__cause__ = exc
        run._finish("failed", error=error)
    finally:
        buffer.close()  # idempotent; also when the run ended before fn was called
        live.install(previous_buffer)
        if timer is not None:
            timer.cancel()


@contextlib.contextmanager
def _redirected(stream: Any) -> Iterator[None]:
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield


def _device_name(plan: LaunchPlan) -> str:
    if plan.device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(plan.gpus[0])
