"""``import gradfleet`` and the CLI commands that do not train stay cheap.

What is loaded is checked, not how long it takes (timings: benchmarks/startup/import_time.py): in a
fresh interpreter, nothing heavy may be in ``sys.modules`` that ``import torch`` itself did
not already load.
"""

from __future__ import annotations

import json
import subprocess
import sys

# Seconds of import each, all needed only to train: the fused path's compiler, plotting,
# TensorFlow (a test reference only), the elastic launcher behind `train -n N`.
HEAVY = (
    "torch._inductor",
    "torch._dynamo",
    "sympy",
    "matplotlib",
    "tensorflow",
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
)

PROBE = """
import json, sys
HEAVY = {heavy!r}
def loaded():
    return sorted(m for m in HEAVY if m in sys.modules)
out = {{}}
import torch
out["torch"] = loaded()
import gradfleet
out["import gradfleet"] = loaded()
import gradfleet.distributed
out["import gradfleet.distributed"] = loaded()
from typer.testing import CliRunner
from gradfleet.cli.main import app
out["import gradfleet.cli.main"] = loaded()
runner = CliRunner()
for args in (["--help"], ["list"], ["train", "-o", "nosuchopt"], ["train", "--lr", "-1"]):
    res = runner.invoke(app, args)
    out["gradfleet " + " ".join(args)] = [res.exit_code, loaded()]
# The probe sees lazily loaded modules: the fused path's first use loads inductor.
from gradfleet.kernels import _torch_private
_torch_private.inductor_config()
out["after the fused path's first use"] = loaded()
print(json.dumps(out))
"""


def test_import_and_cli_without_training_load_nothing_heavy():
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    base = set(out.pop("torch"))  # whatever this torch release loads by itself
    assert "torch._inductor" in out.pop("after the fused path's first use")
    codes = {"--help": 0, "list": 0, "nosuchopt": 2, "-1": 2}
    for step, value in out.items():
        if step.startswith("gradfleet "):
            code, value = value
            assert code == codes[step.split()[-1]], step
        assert set(value) <= base, f"{step} loaded {sorted(set(value) - base)}"
