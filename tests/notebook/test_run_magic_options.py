"""``%ddp_run``'s line, read without a kernel: nbddp's options before the script, the script's
own after it (whatever they look like), ``-m``; and the magics page names every option."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbddp.notebook.run_magic import parser

pytestmark = pytest.mark.unit
MAGICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "magics.md"


def parsed(line: str):
    return parser().parse_args(shlex.split(line))


def test_what_follows_the_script_is_the_scripts_own():
    args = parsed("-n 2 --env A=1 --env B=2 train.py -n 8 --env x --debug")
    assert (args.num_workers, args.env, args.debug, args.module) == (
        2,
        ["A=1", "B=2"],
        False,
        False,
    )
    assert (args.script, args.args) == ("train.py", ["-n", "8", "--env", "x", "--debug"])
    args = parsed("--device cpu -m pkg.train --epochs 3")
    assert (args.module, args.script, args.args) == (True, "pkg.train", ["--epochs", "3"])


def test_a_bad_option_is_a_usage_error_naming_it():
    with pytest.raises(UsageError, match="argument --device: invalid choice: 'gpu'"):
        parsed("--device gpu train.py")


def test_the_magics_page_names_every_option():
    page = MAGICS_PAGE.read_text()
    section = page[page.index("## `%ddp_run`") : page.index("## `%ddp_session`")]
    options = {s for action in parser()._actions for s in action.option_strings}
    missing = sorted(o for o in options if f"`{o}" not in section and f" {o}" not in section)
    assert not missing, f"docs/reference/magics.md does not say what {missing} do"
