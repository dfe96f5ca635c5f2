"""The controller's own CPU per streamed token, in one process: no HTTP server, no sockets.

`PDController.generate` runs as vLLM's server would call it, for N streams at once, over a real
`Pool`: a prefill worker's and a decode worker's outputs are encoded as workers encode them and
handed to the pool's receive path (decode, dispatch, the leg's mailbox), one message per decode
step carrying a token for every stream. What this measures is pdserve's part of a token's way
out (decode, relay, Stream, metrics, the RequestOutput), the part `pdserve bench overhead
--part c` cannot separate from vLLM's serving layer, the HTTP writes and the machine's noise.

    .venv/bin/python scripts/controller_path_cost.py [--streams 32] [--tokens 256] [--runs 7]

Prints CPU microseconds per token for each run (the minimum is the least disturbed) and the
controller's work per request up to its decode leg. Pin it (`taskset -c 1`) on a busy host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import uvloop  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from pdserve import fake, protocol  # noqa: E402
from pdserve.controller import pool as pool_module  # noqa: E402
from pdserve.controller.client import PDController  # noqa: E402
from pdserve.controller.metrics import Metrics  # noqa: E402
from pdserve.controller.pool import Pool  # noqa: E402
from pdserve.models import ensure_model  # noqa: E402
from pdserve.protocol import Output, Outputs, Phase, Role, SeqDelta  # noqa: E402

PROMPT_LEN = 256


class Workers:
    """Stands in for the workers: keeps what the controller sends them (encoded, as a send
    would) and answers with encoded outputs."""

    def __init__(self) -> None:
        self.sent: list[protocol._Msg] = []
        self.decoding: list[str] = []

    def send_nowait(self, sock, msg: protocol._Msg, to: bytes | None = None) -> None:
        protocol.encode(msg)
        self.sent.append(msg)

    def answer_prefills(self, pool: Pool) -> None:
        outs = []
        for msg in self.sent:
            if isinstance(msg, protocol.Generate) and msg.phase == Phase.PREFILL:
                kv = {"do_remote_prefill": True, "remote_engine_id": "p",
                      "remote_request_id": msg.request_id, "remote_host": "127.0.0.1",
                      "remote_port": 0, "remote_block_ids": [0],
                      "remote_num_tokens": len(msg.prompt_token_ids)}
                outs.append(Output(msg.request_id, [SeqDelta(0, " a", [7], None, None,
                                                             "length")], True, 0, kv))
            elif isinstance(msg, protocol.Generate) and msg.phase == Phase.DECODE:
                self.decoding.append(msg.request_id)
        self.sent.clear()
        if outs:
            deliver(pool, b"p", outs)

    def step(self, pool: Pool, k: int, last: bool) -> None:
        deliver(pool, b"d", [Output(rid, [SeqDelta(0, f" t{k}", [k], None, None,
                                                   "length" if last else None)], last)
                             for rid in self.decoding])


def deliver(pool: Pool, identity: bytes, outs: list[Output]) -> None:
    pool._receive([identity, *protocol.encode(Outputs(outs))])


async def run(config, streams: int, tokens: int) -> tuple[float, float]:
    """(CPU us per decoded token, CPU us per request up to its decode leg)."""
    workers = Workers()
    # Every send of the pool, and of nothing else here, goes to the stand-in workers.
    pool_module.transport.send_nowait = workers.send_nowait  # type: ignore[assignment]
    pool = Pool("tcp://127.0.0.1:0", expected=fake.fake_info())
    ctl = PDController(config, pool, metrics=Metrics(CollectorRegistry()))
    for wid, role in (("p", Role.PREFILL), ("d", Role.DECODE)):
        pool._dispatch(wid.encode(), protocol.Register(wid, role, "127.0.0.1", fake.fake_info(),
                                                       pid=1, max_seqs=streams))
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    got = 0

    async def client(i: int) -> None:
        nonlocal got
        async for out in ctl.generate({"prompt_token_ids": [100 + i] * PROMPT_LEN}, params,
                                      f"r{i}"):
            got += len(out.outputs[0].token_ids)

    t_start = time.process_time()
    clients = [asyncio.create_task(client(i)) for i in range(streams)]
    while len(workers.decoding) < streams:  # prefills, then the handoffs
        await asyncio.sleep(0)
        workers.answer_prefills(pool)
    t0, got0 = time.process_time(), got
    for k in range(1, tokens):  # the prefill drew the first token
        workers.step(pool, k, last=k == tokens - 1)
        for _ in range(3):  # the streams' readers take their token
            await asyncio.sleep(0)
    await asyncio.gather(*clients)
    t1 = time.process_time()
    await pool.close()
    return 1e6 * (t1 - t0) / (got - got0), 1e6 * (t0 - t_start) / streams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    config = AsyncEngineArgs(model=str(ensure_model("tiny")), dtype="float32",
                             enforce_eager=True).create_engine_config()
    runs = [uvloop.run(run(config, args.streams, args.tokens)) for _ in range(args.runs)]
    per_token = [r[0] for r in runs]
    print(f"{args.streams} streams, {args.tokens} tokens each")
    print("controller CPU per token (us): " + ", ".join(f"{x:.1f}" for x in per_token)
          + f"; min {min(per_token):.1f}")
    print("per request, up to its decode leg (us): "
          + ", ".join(f"{r[1]:.0f}" for r in runs))


if __name__ == "__main__":
    main()
