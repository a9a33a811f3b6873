"""bench/step_hlo.py: metadata never makes two programs differ, an op always does, and the bench
sees the fused attention's program as another program than the earlier explicit one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.step_hlo import strip

ROOT = Path(__file__).resolve().parents[1]
HLO = """HloModule jit_train_step_{name}, entry_computation_layout={{(f32[4]{{0}})->f32[4]{{0}}}}

FileNames
1 "{path}"

%fused_computation (p: f32[4]) -> f32[4] {{
  %p = f32[4]{{0}} parameter(0)
  ROOT %e = f32[4]{{0}} {op}(%p), metadata={{op_name="jit(train_step)/{name}" source_file="{path}" source_line={line}}}
}}
"""


def test_strip_ignores_where_an_op_came_from_but_not_what_it_is():
    a = HLO.format(name="a", path="/old/trainer/model.py", line=12, op="exponential")
    b = HLO.format(name="b", path="/new/trainer/attention.py", line=99, op="exponential")
    c = HLO.format(name="a", path="/old/trainer/model.py", line=12, op="log")
    assert strip(a) == strip(b) and "exponential" in strip(a)
    assert strip(a) != strip(c)


@pytest.mark.slow  # two compiles in child processes
def test_the_bench_sees_another_program():
    out = subprocess.run([sys.executable, "-m", "bench.step_hlo", "--preset", "tiny", "--levels", "off",
                          "--set", "model.attention=fused"],  # the only change: the old side is explicit
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["errors"] == {} and r["levels"]["off"]["identical"] is False and r["identical"] is False
