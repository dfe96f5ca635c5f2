"""A real prefill engine frees, at its worker's word, the blocks it holds for decodes that will
never read them (`Engine.release_held`, pdserve/kv/cpu_nixl.py): what a worker asks when it
aborted prefill legs whose last outputs, naming those blocks, had not left it. The race itself is
in tests/control/test_aborts.py; here one engine, in a process of its own, holds two prefills'
blocks, frees one leg's, then the other's, named as the engine reported it (as a controller with
no decode worker to carry a release names it), and never lets a lease run out."""

from __future__ import annotations

import json
import sys
import textwrap

from procs import Proc, free_port, wait_for
from test_openai import prompt_ids

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from pdserve.protocol import Role
    from pdserve.worker.engine import EngineSettings, VllmEngine
    from pdserve.worker.main import make_parser

    async def run(engine, rid, prompt, kv=None):
        extra = {"kv_transfer_params": kv} if kv else None
        params = SamplingParams(max_tokens=1, temperature=0, extra_args=extra)
        async for out in engine.generate(rid, prompt, params):
            last = out
        return last.kv_transfer_params

    async def held(engine, n):
        # Blocks in use after a one-token request (the engine reports each step's figures).
        await run(engine, f"step-{n}", [5, 6, 7])
        return round(engine.load().kv_usage * engine.kv_blocks)

    async def main(model, port, prompts):
        args = make_parser().parse_args(["--model", model, "--role", "prefill"])
        settings = EngineSettings(Role.PREFILL, kv_port=port, cores="0", kv_events=False)
        engine = VllmEngine(settings, AsyncEngineArgs.from_cli_args(args))
        try:
            remote = {"do_remote_decode": True}
            a = await run(engine, "leg-a", prompts[0], remote)
            b = await run(engine, "leg-b", prompts[1], remote)
            blocks = [len(kv["remote_block_ids"][0]) for kv in (a, b)]
            both = await held(engine, 0)
            await engine.release_held(["leg-a"])
            one = await held(engine, 1)
            await engine.release_held([b["remote_request_id"], "leg-never-here"])
            none = await held(engine, 2)
            print("RESULT " + json.dumps({"blocks": blocks, "held": [both, one, none]}),
                  flush=True)
        finally:
            engine.shutdown()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
""")

FREED = "at its worker's word: no decode will read them"
EXPIRED = "Releasing expired KV blocks"


def test_a_prefill_engine_frees_held_blocks_at_its_workers_word(model_dir, logs):
    prompts = [prompt_ids(300, seed=7001), prompt_ids(300, seed=7002)]
    proc = Proc("held-blocks", [sys.executable, "-c", SCRIPT, model_dir, str(free_port()),
                                json.dumps(prompts)], logs)
    try:  # the script stops its engine itself: a signal to its group would orphan the core
        wait_for(lambda: not proc.alive(), 300, "the engine to run its prefills and stop")
    finally:
        proc.stop()
    lines = [ln for ln in proc.log().splitlines() if ln.startswith("RESULT ")]
    assert proc.proc.returncode == 0 and lines, proc.log()[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    a, b = result["blocks"]
    assert a == b == 3  # 300 tokens in blocks of 128
    assert result["held"] == [a + b, b, 0]
    log = proc.log()
    assert sum(FREED in ln for ln in log.splitlines()) == 2
    assert EXPIRED not in log
