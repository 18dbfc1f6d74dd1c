"""A long log keeps its start: the saved summary holds rank 0's first and last lines, and a
file (its user's alone) holds every line once the two ends no longer meet."""

from __future__ import annotations

import os
import re
import stat

import nbformat
import pytest
from conftest import run_notebook

from nbddp.display.html import summary_html
from nbddp.display.plain import panel_text
from nbddp.state.run import RunState
from nbddp.state.transcript import LOG_DIRECTORY, Transcript


def lines(first: int, last: int) -> str:
    return "".join(f"line {i}\n" for i in range(first, last + 1))


@pytest.mark.unit
def test_short_output_is_kept_whole_and_no_file_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    transcript = Transcript(head=5, tail=5)
    transcript.feed("epoch 1: 10%\repoch 1: 100%\n" + lines(1, 8))  # a redrawn bar: one line
    assert transcript.head_text() == "epoch 1: 100%\n" + lines(1, 4)
    assert transcript.text() == lines(5, 8) and transcript.dropped == 0
    transcript.close()
    assert transcript.file == "" and not os.path.exists(LOG_DIRECTORY)


@pytest.mark.unit
def test_a_long_stream_keeps_both_ends_and_every_line_goes_to_a_private_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    transcript = Transcript(head=3, tail=4)
    for i in range(1, 21):  # fed in pieces that split lines
        transcript.feed(f"line {i}")
        transcript.feed("\n")
    transcript.feed("the open line")
    transcript.close()
    assert transcript.head_text() == lines(1, 3)
    assert transcript.text() == lines(17, 20) + "the open line"
    assert transcript.dropped == 13
    path = transcript.file
    assert os.path.dirname(path) == str(tmp_path / LOG_DIRECTORY)
    with open(path) as log:
        assert log.read() == lines(1, 20) + "the open line\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


@pytest.mark.unit
def test_the_kept_ends_are_bounded_in_characters_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    transcript = Transcript(head=100, tail=100, characters=50)
    transcript.feed("".join(f"{i:09d}\n" for i in range(100)))  # 9 characters a line
    assert len(transcript.head) == 5 and len(transcript.lines) == 5
    assert transcript.dropped == 90
    transcript.close()
    with open(transcript.file) as log:
        assert len(log.read().splitlines()) == 100


@pytest.mark.unit
def test_an_unwritable_working_directory_puts_the_file_in_a_private_temp_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / LOG_DIRECTORY).write_text("a file where the directory would go")
    transcript = Transcript(head=1, tail=1)
    transcript.feed(lines(1, 5))
    transcript.close()
    assert "nbddp-logs-" in transcript.file
    assert stat.S_IMODE(os.stat(os.path.dirname(transcript.file)).st_mode) == 0o700
    with open(transcript.file) as log:
        assert log.read() == lines(1, 5)
    os.remove(transcript.file)
    os.rmdir(os.path.dirname(transcript.file))


@pytest.mark.unit
def test_nowhere_to_write_keeps_both_ends_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / LOG_DIRECTORY).write_text("a file where the directory would go")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkdtemp", no_space)
    state = RunState(1, "cpu", "gloo", "cpu")
    state._transcript = Transcript(head=2, tail=2)
    state.add_output(lines(1, 10))  # no error reaches the output's writer
    state.finish("succeeded", None)
    page = summary_html(state.snapshot(final=True))
    assert "line 1\n" in page and "line 10\n" in page
    assert "6 lines not shown here; all of rank 0's output: not saved" in page


@pytest.mark.unit
def test_the_saved_summary_shows_both_ends_and_links_the_whole_log(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = RunState(2, "cpu", "gloo", "cpu")
    state.panel_output = True
    state._transcript = Transcript(head=3, tail=3)
    state.add_output(lines(1, 10))
    assert state.snapshot().output_head == ""  # live: the panel's window only
    state.finish("succeeded", None)
    final = state.snapshot(final=True)
    page = summary_html(final)
    assert "line 1\n" in page and "line 3\n" in page and "line 10\n" in page
    assert "line 4\n" not in page and "4 lines not shown here" in page
    link = os.path.join(LOG_DIRECTORY, os.path.basename(final.output_file))
    assert f'<a href="{link}"' in page
    assert final.output_file in panel_text(final)


def chatty_notebook(count: int) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import nbddp"),
        nbformat.v4.new_code_cell(
            "def chatty():\n"
            f"    for i in range(1, {count + 1}):\n"
            f"        print(f'log line {{i}} of {count}')\n"
            "nbddp.notebook_launch(chatty, num_workers=2, device='cpu')"
        ),
    ]
    return notebook


@pytest.mark.e2e
@pytest.mark.parametrize("count", [1_000, 6_000])
def test_a_saved_notebook_keeps_the_first_and_last_line_of_a_long_log(tmp_path, count):
    notebook = chatty_notebook(count)
    run_notebook(notebook, timeout=180, path=tmp_path)
    nbformat.write(notebook, tmp_path / "saved.ipynb")
    saved = nbformat.read(tmp_path / "saved.ipynb", as_version=4)
    [summary] = [o for o in saved.cells[1].outputs if "nbddp-summary" in str(o.get("data"))]
    page = summary["data"]["text/html"]
    assert f"log line 1 of {count}\n" in page and f"log line {count} of {count}\n" in page
    logs = list((tmp_path / LOG_DIRECTORY).glob("*.log")) if count > 4_000 else []
    if count <= 4_000:  # kept whole, as a normal cell would keep it
        assert all(f"log line {i} of {count}\n" in page for i in range(1, count + 1))
        assert not (tmp_path / LOG_DIRECTORY).exists()
        return
    [log] = logs
    assert re.search(rf"{count - 4_000:,} lines not shown here; all of rank 0's output: ", page)
    assert f'<a href="{LOG_DIRECTORY}/{log.name}"' in page
    assert str(log) in summary["data"]["text/plain"]
    assert log.read_text() == "".join(f"log line {i} of {count}\n" for i in range(1, count + 1))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
