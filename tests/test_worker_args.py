"""`pdserve worker` takes vLLM's engine flags with vLLM's own defaults: a worker's engine runs as
a plain `vllm serve` would run it (compiled, CUDA graphs on a GPU), unless told otherwise."""

from __future__ import annotations

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from pdserve.worker.main import make_parser


def test_the_worker_takes_vllms_engine_defaults():
    ours = make_parser().parse_args(["--role", "decode", "--controller", "tcp://127.0.0.1:9"])
    theirs = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([])
    differ = {k for k, v in vars(theirs).items() if getattr(ours, k) != v}
    assert differ == {"model"}  # ours comes from --model or the built-in preset
    assert ours.enforce_eager is False
    eager = make_parser().parse_args(["--role", "decode", "--controller", "tcp://127.0.0.1:9",
                                      "--enforce-eager"])
    assert eager.enforce_eager is True
