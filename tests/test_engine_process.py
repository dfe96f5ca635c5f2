"""Which executor a worker's engine gets: on a CPU host one engine runs its model inside its
engine core (vLLM CPU alone would add a model-runner process that busy-polls beside it), unless
the user asks for vLLM's multiprocess executor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.models import ensure_model
from pdserve.worker.engine import is_cpu_host

# Build the engine config as a worker does, once per argument list, and name its executor. In a
# process of its own: vLLM's CPU platform sets environment variables while it checks a config,
# and vLLM logs to stdout.
EXECUTOR_OF = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.executor import Executor
from pdserve.protocol import Role
from pdserve.worker.engine import EngineSettings, configure
from pdserve.worker.main import make_parser
for argv in json.loads(sys.argv[1]):
    args = AsyncEngineArgs.from_cli_args(make_parser().parse_args(argv))
    config = configure(args, EngineSettings(Role.DECODE), cpu=True).create_engine_config()
    print("executor:", Executor.get_class(config).__name__)
"""

CHOICES = {
    "default": ([], "UniProcExecutor"),
    "uni": (["--distributed-executor-backend", "uni"], "UniProcExecutor"),
    "mp": (["--distributed-executor-backend", "mp"], "MultiprocExecutor"),
}


@pytest.fixture(scope="module")
def executors() -> dict[str, str]:
    if not is_cpu_host():
        pytest.fail("these tests describe a CPU host")
    model = str(ensure_model("tiny"))
    argvs = [["--role", "decode", "--model", model, *extra] for extra, _ in CHOICES.values()]
    out = subprocess.run([sys.executable, "-c", EXECUTOR_OF, json.dumps(argvs)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    named = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("executor: ")]
    return dict(zip(CHOICES, named))


@pytest.mark.parametrize("choice", CHOICES)
def test_a_cpu_engine_runs_its_model_where_the_user_chose(choice, executors):
    assert executors[choice] == CHOICES[choice][1]
