"""Which names a %%ddp cell takes from the notebook and which it gives back."""

import pytest

from nbddp.notebook.cell import analyze, shows_last_value

pytestmark = pytest.mark.unit


def reads(source: str) -> set[str]:
    return set(analyze(source).reads)


def writes(source: str) -> list[str]:
    return list(analyze(source).writes)


def test_defined_before_read_is_not_shipped():
    assert reads("x = 1\ny = x + offset") == {"offset"}
    assert writes("x = 1\ny = x + offset") == ["x", "y"]


def test_read_before_rebinding_is_shipped():
    assert reads("model = model.to(device)") == {"model", "device"}
    assert reads("total += step") == {"total", "step"}


def test_shadowing_by_import_def_class_and_with():
    source = (
        "import torch.nn as nn\nfrom math import sqrt as root\n"
        "def f(a):\n    return a\nclass C:\n    pass\n"
        "with open(path) as fh:\n    text = fh.read()\n"
        "out = nn, root, f, C, fh, text"
    )
    assert reads(source) == {"open", "path"}
    assert writes(source) == ["nn", "root", "f", "C", "fh", "text", "out"]


def test_comprehension_variables_stay_inside():
    assert reads("squares = [i * k for i in range(n) if i > lo]") == {"range", "n", "k", "lo"}
    assert "i" not in writes("squares = [i * k for i in range(n)]")


def test_nested_functions_read_globals_at_call_time():
    source = "def step(batch):\n    return model(batch) * scale\nresult = step(x)"
    assert reads(source) == {"model", "scale", "x"}
    assert writes(source) == ["step", "result"]


def test_globals_assigned_in_loops_and_nested_functions_come_back():
    source = (
        "for epoch in range(epochs):\n    best = epoch\n"
        "def bump():\n    global counter\n    counter = counter + 1\n"
    )
    assert {"epoch", "best", "bump", "counter"} <= set(writes(source))
    assert {"range", "epochs", "counter"} <= reads(source)


def test_branches_only_maybe_bind():
    assert "lr" in reads("if warm:\n    lr = 0.1\nopt = make(lr)")


def test_del_reads_and_writes():
    assert reads("del old") == {"old"}
    assert writes("del old") == ["old"]
    assert reads("tmp = 1\ndel tmp") == set()


def test_class_bodies_and_decorators():
    source = "@register\nclass Net(Base):\n    width = hidden\n    def f(self):\n        return act"
    assert reads(source) == {"register", "Base", "hidden", "act"}


def test_ipython_names_never_travel():
    assert reads("print(_, In, Out)") == {"print"}


def test_last_value_shown_like_ipython():
    assert shows_last_value("x = 1\nx")
    assert not shows_last_value("x = 1\nx;")
    assert not shows_last_value("x = 1")


def test_syntax_errors_surface():
    with pytest.raises(SyntaxError):
        analyze("def broken(:\n")


def test_loop_targets_bind_inside_their_body_only():
    assert reads("for q in items:\n    total = q\nprint(q)") == {"items", "q", "print"}
    source = "try:\n    import fast as lib\nexcept ImportError as e:\n    err = e\n"
    assert reads(source) == {"ImportError"}
