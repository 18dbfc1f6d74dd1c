"""Only the user who started a detached run can list it, attach to it or stop it: another
user (a throwaway account made for the test, as root) sees no run, is refused by id, cannot
read the run's key or reach its supervisor's socket; and a wrong key is refused by the
supervisor's handshake."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import TWO_CPU_QUIET
from detached.support import no_standby, runs_dir, supervisor_of

import nbddp
from nbddp.detached import store
from nbddp.detached.attached import attach
from nbddp.detached.info import runs
from nbddp.wire.transport import AuthenticationFailed, connect

pytestmark = pytest.mark.ranks

__all__ = ["no_standby", "runs_dir"]  # autouse fixtures (support.py)


def waits_for(go: str) -> int:
    import os
    import time

    while not os.path.exists(go):
        time.sleep(0.01)
    return 7


@pytest.fixture(autouse=True, scope="module")
def by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def other_user():
    """A throwaway account, removed afterwards, and a home of its own."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a throwaway account")
    name = f"nbddp-other-{os.getpid() % 100000}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
    )
    home = tempfile.mkdtemp(prefix="nbddp-other-home-")  # pytest's own tmp is root's only
    try:
        account = pwd.getpwnam(name)
        os.chown(home, account.pw_uid, account.pw_gid)
        yield account, home
    finally:
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run(["userdel", name], check=False)


def as_user(account: pwd.struct_passwd, home: str, checks) -> dict:
    """Run ``checks()`` in a child process that became ``account`` (everything it uses is
    imported already: root's Python installation is not readable by others); its result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, then answer
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            os.environ["HOME"] = home
            os.environ.pop(store.RUNS_DIR_VARIABLE, None)
            os.write(write, json.dumps(checks()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the other user's checks failed"
    return json.loads(data)


def outcome_of(call) -> str:
    try:
        return f"ok: {call()!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_another_user_can_neither_see_nor_attach_nor_reach_the_run(tmp_path, runs_dir, other_user):
    account, home = other_user
    go = str(tmp_path / "go")
    run = nbddp.notebook_launch(waits_for, (go,), detach=True, **TWO_CPU_QUIET)
    supervisor = store.find(run.id).supervisor()
    assert supervisor is not None and supervisor_of(run.id).is_running()
    mine = str(runs_dir)

    def checks() -> dict:
        def with_my_dir(call):
            os.environ[store.RUNS_DIR_VARIABLE] = mine
            try:
                return outcome_of(call)
            finally:
                del os.environ[store.RUNS_DIR_VARIABLE]

        def read_key() -> bytes:
            with open(os.path.join(mine, run.id, store.KEY), "rb") as f:
                return f.read()

        return {
            "runs": outcome_of(lambda: [r.id for r in runs()]),
            "attach": outcome_of(lambda: attach(run.id, display="none")),
            "runs in my dir": with_my_dir(lambda: [r.id for r in runs()]),
            "attach in my dir": with_my_dir(lambda: attach(run.id, display="none")),
            "key": outcome_of(read_key),
            "socket": outcome_of(lambda: connect(supervisor["address"], b"0" * 32, timeout=5)),
        }

    seen = as_user(account, home, checks)
    assert seen["runs"] == "ok: []"
    assert seen["attach"].startswith(f"ValueError: there is no detached run {run.id} of yours")
    assert "belongs to another user" in seen["runs in my dir"]
    assert "belongs to another user" in seen["attach in my dir"]
    assert seen["key"].startswith("PermissionError")
    assert seen["socket"].startswith("PermissionError")
    # whoever reaches the socket still needs the run's key
    with pytest.raises(AuthenticationFailed):
        connect(supervisor["address"], b"0" * 32, timeout=5)
    assert run.status == "running"
    open(go, "w").close()
    assert run.result(timeout=60) == 7
