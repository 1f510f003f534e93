"""What a run prints where: a bar only on a terminal (or as one notebook widget), step lines
in a log file, process 0 alone; the cuDNN attention fallback says so once."""

import io
import logging
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from gendist.models import attention
from gendist.output import console


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.fixture
def streams(monkeypatch):
    def use(tty):
        out, err = _Stream(tty), _Stream(tty)
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        return out, err
    return use


def test_log_file_gets_step_lines_and_no_bar(streams):
    out, err = streams(tty=False)
    bar = console.Progress(range(3), enabled=True)
    assert bar.bar is None and bar.step_lines
    assert list(bar) == [0, 1, 2]
    console.say("val line")
    bar.close()
    assert out.getvalue() == "val line\n" and err.getvalue() == ""


def test_terminal_gets_a_bar_and_lines_go_above_it(streams):
    out, err = streams(tty=True)
    bar = console.Progress(range(3), enabled=True)
    assert bar.bar is not None and not bar.step_lines
    for i in bar:
        if i == 1:
            console.say("val line")
    bar.close()
    assert "val line\n" in out.getvalue() and "\r" in err.getvalue()  # tqdm.write, bar


def test_notebook_without_widgets_prints_no_progress(streams, monkeypatch):
    out, err = streams(tty=False)
    monkeypatch.setattr(console, "in_notebook", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails
    bar = console.Progress(range(3), enabled=True)
    assert bar.bar is None and not bar.step_lines
    list(bar)
    bar.close()
    assert out.getvalue() == err.getvalue() == ""


def test_other_processes_stay_quiet(streams, monkeypatch):
    out, err = streams(tty=True)
    monkeypatch.setattr(console, "is_main_process", lambda: False)
    bar = console.Progress(range(2), enabled=True)
    assert bar.bar is None and not bar.step_lines
    console.say("rank 1 line")
    assert out.getvalue() == err.getvalue() == ""


def test_cudnn_attention_falls_back_to_xla_off_gpu_once(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_fell_back", set())
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 4)), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="gendist"):
        got = attention.attention(q, q, q, backend="cudnn")
        attention.attention(q, q, q, backend="cudnn")
    want = attention.attention(q, q, q, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["model.attention='cudnn' needs an NVIDIA GPU; using 'xla' attention on cpu"]


@pytest.mark.slow
def test_a_notebook_training_cell_has_at_most_one_progress_output(tmp_path):
    """Executed by a real kernel (as nbmake and Colab do): no stream of bar frames, no step
    lines; at most one widget where ipywidgets is installed."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from pathlib import Path
    tests = str(Path(__file__).parent)
    cell = (f"import sys; sys.path.insert(0, {tests!r})\n"
            "from helpers import small_config\n"
            "from gendist.training import loop\n"
            f"r = loop.run(small_config({str(tmp_path)!r}, steps=4, eval_every=2, "
            "log_every=1, progress=True))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json"
               in o.get("data", {})]
    assert "done: 4 steps" in text and "step 2: val_loss" in text  # the log lines are there
    assert "\r" not in text and "it/s" not in text and "step 1/4" not in text
    assert len(widgets) <= 1
