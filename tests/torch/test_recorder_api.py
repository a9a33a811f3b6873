"""replay.torch on a plain torch model: layers discovered in execution order, its own names, and
every misuse refused with one line that says what to do."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import replay.torch  # noqa: E402
import traces  # noqa: E402
from replay.torch import ParamName, TensorNames, TorchRecordError  # noqa: E402
from replay.torch.fingerprint import fingerprint  # noqa: E402


class Net(torch.nn.Module):
    """Modules registered in another order than they run, to show the order is execution order."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 5)
        self.embed = torch.nn.Embedding(11, 8)
        self.act = torch.nn.Tanh()

    def forward(self, tokens):
        return self.head(self.act(self.embed(tokens))).mean(dim=1)


def _loop(run, model, opt, steps=2, body=None):
    for k in range(steps):
        rows = (torch.arange(12).reshape(3, 4) + k) % 11
        with run.step(rows) as rec:
            out = model(rows)
            loss = out.square().mean()
            loss.backward()
            opt.step()
            (body or (lambda r, o: r.metrics(loss=loss, example_loss=o.square().mean(dim=1))))(rec, out)
        opt.zero_grad()


def test_a_plain_model_records_under_its_own_names(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = replay.torch.init(tmp_path / "r", config={"lr": 0.1}, model=model, optimizer=opt)
    _loop(run, model, opt)
    run.finish()
    r = traces.Run.open(tmp_path / "r")
    assert [n for n, k in r.schema.tensors if k == "forward"] == ["embed", "act", "head"]
    assert [n for n, k in r.schema.tensors if k == "update"] == ["param/head.weight", "param/head.bias",
                                                                   "param/embed.weight"]
    assert r.schema.example_metrics == ("loss",)
    rec = r.trace.read(1)
    got = dict(zip(r.schema.tensor_names, rec.fingerprints))
    assert got["param/embed.weight"] == fingerprint(model.embed.weight)
    assert rec.example_metrics.shape == (1, 3)
    assert r.manifest["config"] == {"lr": 0.1} and r.manifest["names"]["layers"] is None


def test_a_recompute_is_accepted_and_a_second_microbatch_refused(tmp_path):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = replay.torch.init(tmp_path / "ok", model=model)
    rows = torch.zeros(3, 4, dtype=torch.long)
    with run.step(rows) as rec:
        loss = model(rows).sum() + model(rows).sum()  # the same inputs twice: equal bits
        rec.metrics(loss=loss)
    run.finish()
    run = replay.torch.init(tmp_path / "bad", model=model, optimizer=opt)
    with run.step(rows) as rec:
        loss = model(rows).sum() + model(rows + 1).sum()
        rec.metrics(loss=loss)
    with pytest.raises(TorchRecordError, match="ran 2 times with different outputs"):
        run.finish()
    assert traces.Run.open(tmp_path / "bad").status == "crashed"


def test_a_failing_body_records_nothing(tmp_path):
    model = Net()
    run = replay.torch.init(tmp_path / "r", model=model)
    with pytest.raises(ZeroDivisionError):
        with run.step(torch.zeros(3, 4, dtype=torch.long)) as rec:
            model(torch.zeros(3, 4, dtype=torch.long))
            1 / 0
    assert run.next_step == 0
    with run.step(torch.zeros(3, 4, dtype=torch.long)) as rec:
        rec.metrics(loss=model(torch.zeros(3, 4, dtype=torch.long)).sum())
    run.finish()
    assert len(traces.Run.open(tmp_path / "r").trace) == 1


def test_metric_bits_are_exact(tmp_path):
    run = replay.torch.init(tmp_path / "r", level="step")
    nan = torch.from_numpy(np.array(0x7FC01234, np.uint32).view(np.float32))  # a NaN with a payload
    with run.step(torch.zeros(2, 3, dtype=torch.long)) as rec:
        rec.metrics(loss=torch.tensor(-0.0), odd=nan, third=1 / 3)
    run.finish()
    r = traces.Run.open(tmp_path / "r")
    bits = r.trace.read(0).metrics.view(np.uint32)
    assert bits.tolist() == [0x80000000, 0x7FC01234, int(np.float32(1 / 3).view(np.uint32))]
    assert r.schema.tensors == () and r.schema.metrics[1] == ("odd", "update")


@pytest.mark.parametrize("case", ["no loss", "no metrics", "bad shape", "other metrics", "other batch"])
def test_misuse_is_one_clear_error(tmp_path, case):
    run = replay.torch.init(tmp_path / "r", level="step")
    rows = torch.zeros(2, 3, dtype=torch.long)
    if case in ("other metrics", "other batch"):
        with run.step(rows) as rec:
            rec.metrics(loss=1.0)
    words = {"no loss": "no scalar metric 'loss'", "no metrics": "recorded no metrics", "bad shape": "neither a scalar",
             "other metrics": "record the same metrics", "other batch": "the same number every step"}[case]
    with pytest.raises(TorchRecordError, match=words):
        with run.step(torch.zeros(5, 3, dtype=torch.long) if case == "other batch" else rows) as rec:
            if case == "no loss":
                rec.metrics(lss=1.0)
            elif case == "other metrics":
                rec.metrics(loss=1.0, extra=2.0)
            elif case == "bad shape":
                rec.metrics(loss=1.0, x=torch.zeros(2, 2))
            elif case == "other batch":
                rec.metrics(loss=1.0)
    run.close()


def test_a_name_map_for_another_model_is_refused(tmp_path):
    model = Net()
    wrong = TensorNames(params=(ParamName("w", "head.weight", (1, 0)),), layers=(("x", "head"),), source="test")
    with pytest.raises(TorchRecordError, match="leave out 2 trainable parameter"):
        replay.torch.init(tmp_path / "a", model=model, names=wrong)
    with pytest.raises(TorchRecordError, match="does not have"):
        replay.torch.init(tmp_path / "b", model=model,
                          names=TensorNames(params=(ParamName("w", "nope"),), source="test"))
    with pytest.raises(TorchRecordError, match="level='layer'"):
        replay.torch.init(tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    replay.torch.init(tmp_path / "d", level="step").finish()
    with pytest.raises(TorchRecordError, match="not empty"):
        replay.torch.init(tmp_path / "d", level="step")


@pytest.mark.slow  # a fresh process: this one has JAX imported already
def test_recording_never_imports_jax(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import sys, torch, replay.torch
model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7))
run = replay.torch.init({str(tmp_path / 'r')!r}, model=model)
rows = torch.zeros(2, 3, dtype=torch.long)
with run.step(rows) as rec:
    loss = model(rows).sum()
    loss.backward()
    rec.metrics(loss=loss)
run.finish()
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'orbax', 'trainer'))
print(bad)
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    assert traces.Run.open(tmp_path / "r").status == "complete"


def test_bisect_of_torch_runs_compares_traces_and_refuses_a_replay_in_one_line(tmp_path):
    from tests.cli_util import invoke, last_json

    for name, lr in (("a", 0.1), ("b", 0.2)):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        run = replay.torch.init(tmp_path / name, config={"lr": lr}, model=model, optimizer=opt)
        _loop(run, model, opt, steps=3)
        run.finish()
    out = invoke("bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--no-refine", "--json")
    assert out.exit_code == 1, out.output
    report = last_json(out)
    assert (report["first_step"], report["cause"]) == (0, "update"), report  # SGD's update is the first to differ
    out = invoke("bisect", str(tmp_path / "a"), str(tmp_path / "b"))  # refinement needs a replay: none here
    assert out.exit_code == 2 and "replay.torch" in out.stderr and "--no-refine" in out.stderr, out.output
    assert "Traceback" not in out.output


_STOPS_AFTER_3 = """
import sys
import torch
import replay.torch
from tests.torch.test_recorder_api import Net, _loop
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run = replay.torch.init(sys.argv[1], config={"lr": 0.1}, model=model, optimizer=opt)
_loop(run, model, opt, steps=3)
raise RuntimeError("the loop stops after step 2")
"""


def test_a_loop_that_stops_on_an_error_without_finishing_keeps_its_last_finished_step(tmp_path):
    """A torch loop stopped by an uncaught error after steps 0-2, with no finish() and no `with`: the
    record of step 2, held until a next step, is written at exit (one stderr line says so), and the
    run stays incomplete. Before, the trace ended at step 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _STOPS_AFTER_3, str(tmp_path / "run")], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "the loop stops after step 2" in done.stderr, done.stderr
    run = traces.Run.open(tmp_path / "run")
    assert (run.trace.end, run.status) == (3, "crashed"), (run.trace.end, run.status)
    assert "at exit wrote the record of its last finished step 2" in done.stderr, done.stderr
