"""`pdserve bench`'s cache-friendly workloads (multiturn, shared-prefix) and how the arguments pick
a load. Pure: no server, no engine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from pdserve.bench import chats, loads, workload
from pdserve.bench.main import make_parser
from pdserve.bench.metrics import Slo

VOCAB = list(range(4, 2048))


def multiturn(n: int = 200, rate: float = 2.0, seed: int = 0) -> list[chats.Conversation]:
    return chats.make_chats(chats.MULTITURN, n, rate, 1.0, seed)


def shared(n: int = 200, rate: float = 2.0, seed: int = 0) -> list[chats.Conversation]:
    return chats.make_chats(chats.SHARED_PREFIX, n, rate, 1.0, seed)


# ---- multiturn -----------------------------------------------------------------------------


def test_chats_are_deterministic_for_a_seed() -> None:
    assert multiturn(seed=3) == multiturn(seed=3)
    assert multiturn(seed=3) != multiturn(seed=4)
    assert shared(seed=3) == shared(seed=3)


@pytest.mark.parametrize("n", [1, 5, 8, 200])
def test_multiturn_has_n_requests_in_conversations_of_3_to_6_turns(n: int) -> None:
    convs = multiturn(n)
    assert sum(len(c.turns) for c in convs) == n
    assert len(chats.requests(convs)) == n
    assert all(3 <= len(c.turns) <= 6 for c in convs[:-1])
    assert 1 <= len(convs[-1].turns) <= 6  # the last one is cut to make n exactly
    assert [c.index for c in convs] == list(range(len(convs)))
    turns = [t for c in convs for t in c.turns]
    assert all(100 <= t.user_len <= 300 and t.output_len == 128 for t in turns)
    # One system prompt for all, 1000 tokens rounded down to whole 16-token chunks.
    assert {(c.prefix, c.system_len) for c in convs} == {(0, 992)}


def test_multiturn_think_times_are_exponential_between_turns() -> None:
    convs = multiturn(4000)
    assert all(c.turns[0].think == 0.0 for c in convs)
    later = [t.think for c in convs for t in c.turns[1:]]
    assert all(x > 0 for x in later)
    assert np.mean(later) == pytest.approx(2.0, rel=0.08)
    assert np.std(later) / np.mean(later) == pytest.approx(1.0, abs=0.1)


def test_multiturn_prompts_grow_by_each_reply_and_user_turn() -> None:
    conv = multiturn()[0]
    lens = chats.prompt_lens(conv)
    assert lens[0] == conv.system_len + conv.turns[0].user_len
    for k in range(1, len(lens)):
        assert lens[k] == lens[k - 1] + conv.turns[k - 1].output_len + conv.turns[k].user_len
    longest = max(p + c.turns[-1].output_len for c in multiturn(2000)
                  for p in chats.prompt_lens(c)[-1:])
    assert longest <= chats.MULTITURN.max_context == 1000 + 6 * (300 + 128)


def test_conversations_start_poisson_at_rate_over_mean_turns() -> None:
    n, rate = 9000, 3.0
    convs = multiturn(n, rate)
    starts = [c.start for c in convs]
    assert starts == sorted(starts)
    conv_rate = rate / 4.5  # turns uniform in 3-6
    assert starts[-1] == pytest.approx(len(convs) / conv_rate)
    assert starts[-1] == pytest.approx(n / rate, rel=0.05)  # n requests start over ~n / rate
    gaps = np.diff([0.0, *starts])
    assert gaps.mean() == pytest.approx(1 / conv_rate, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)
    assert all(c.start == 0.0 for c in chats.warmup_chats(chats.MULTITURN, 10, 0))
    assert all(t.think == 0.0 for c in chats.warmup_chats(chats.MULTITURN, 10, 0)
               for t in c.turns)


def test_labels_are_turn_numbers_or_system_prompts() -> None:
    convs = multiturn(8)
    labels = chats.labels(convs, "multiturn")
    assert labels == [f"turn{t + 1}" for c in convs for t in range(len(c.turns))]
    one = shared(10)
    assert chats.labels(one, "shared-prefix") == [f"prefix{c.prefix}" for c in one]


# ---- shared-prefix -------------------------------------------------------------------------


def test_shared_prefix_is_short_questions_behind_a_few_long_system_prompts() -> None:
    convs = shared(400, rate=4.0)
    assert len(convs) == 400 and all(len(c.turns) == 1 for c in convs)
    assert {c.prefix for c in convs} == {0, 1, 2, 3}
    by_prefix = {c.prefix: c.system_len for c in convs}
    assert all(c.system_len == by_prefix[c.prefix] for c in convs)  # one length per prompt
    assert all(1000 - 16 < n <= 1500 and n % 16 == 0 for n in by_prefix.values())
    assert all(50 <= c.turns[0].user_len <= 150 for c in convs)
    assert convs[-1].start == pytest.approx(400 / 4.0)


def test_token_ids_depend_on_seed_run_and_role_only() -> None:
    convs = shared(50)
    plan = chats.Plan(0, 1, tuple(convs))
    same = [c for c in convs if c.prefix == convs[0].prefix]
    other = next(c for c in convs if c.prefix != convs[0].prefix)
    system = chats.system_tokens(plan, same[0], VOCAB)
    assert len(system) == same[0].system_len and set(system) <= set(VOCAB)
    assert all(chats.system_tokens(plan, c, VOCAB) == system for c in same)
    assert chats.system_tokens(plan, other, VOCAB)[:16] != system[:16]
    assert chats.system_tokens(chats.Plan(0, 2, plan.conversations), same[0], VOCAB) != system
    users = [chats.user_tokens(plan, c, 0, VOCAB) for c in same]
    assert len({tuple(u) for u in users}) == len(users)
    assert [len(u) for u in users] == [c.turns[0].user_len for c in same]
    # The same in another interpreter, whatever its PYTHONHASHSEED.
    code = (f"from pdserve.bench import chats; c = chats.Conversation(0, {other.prefix}, "
            f"{other.system_len}, 0.0, ()); print(chats.system_tokens(chats.Plan(0, 1, ()), c, "
            "list(range(4, 2048)))[:8])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": seed}, cwd=Path(__file__).parents[1],
                             check=True).stdout
        assert out.strip() == str(chats.system_tokens(plan, other, VOCAB)[:8])


def test_plan_round_trips_through_json() -> None:
    plan = chats.Plan(7, 3, tuple(multiturn(30)))
    assert chats.Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_shared_prefix_trace_shares_leading_hash_ids(tmp_path: Path) -> None:
    items = chats.as_items(shared(40))
    rows = [json.loads(line) for line in
            workload.write_trace(items, tmp_path / "t.jsonl", run=2).read_text().splitlines()]
    for it, row in zip(items, rows):
        assert row["input_length"] == it.input_len
        assert len(row["hash_ids"]) == math.ceil(it.input_len / workload.CHUNK)
    head: dict[int, list[int]] = {}
    own: list[int] = []
    for it, row in zip(items, rows):
        k = it.prefix_len // workload.CHUNK
        assert head.setdefault(it.prefix, row["hash_ids"][:k]) == row["hash_ids"][:k]
        own += row["hash_ids"][k:]
    assert len({tuple(h) for h in head.values()}) == 4
    assert len(own) == len(set(own)) and not set(own) & {i for h in head.values() for i in h}
    with pytest.raises(AssertionError):
        chats.as_items(multiturn(10))  # replies cannot be fed back through a trace


def test_vllm_client_gives_a_shared_prefix_the_same_tokens(tmp_path: Path) -> None:
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")

    class Tok:
        all_special_ids: ClassVar[list[int]] = [0, 1]

        def get_vocab(self) -> dict[str, int]:
            return {f"t{i}": i for i in range(2000)}

    items = chats.as_items(shared(24))
    path = workload.write_trace(items, tmp_path / "t.jsonl")
    trace = datasets.TimedTrace(dataset_path=str(path), timed_trace_label_timestamp="timestamp",
                                timed_trace_label_input_length="input_length",
                                timed_trace_label_output_length="output_length",
                                timed_trace_label_hash_ids="hash_ids")
    prompts = [r.prompt for r in trace.sample(Tok(), len(items))]
    assert [len(p) for p in prompts] == [it.input_len for it in items]
    first: dict[int, list[int]] = {}
    for it, p in zip(items, prompts):
        assert first.setdefault(it.prefix, p[:it.prefix_len]) == p[:it.prefix_len]
    assert len({tuple(p) for p in first.values()}) == len(first)
    questions = [tuple(p[it.prefix_len:]) for it, p in zip(items, prompts)]
    assert len(set(questions)) == len(questions)


# ---- arguments -----------------------------------------------------------------------------


def _load(tmp_path: Path, *argv: str, limit: int = 4096) -> loads.Load:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": limit}))
    args = make_parser().parse_args(list(argv))
    return loads.from_args(args, str(tmp_path), Slo())


def test_workload_flags_pick_the_load(tmp_path: Path) -> None:
    load = _load(tmp_path, "--workload", "multiturn")
    assert isinstance(load, loads.ChatLoad) and load.spec == chats.MULTITURN
    load = _load(tmp_path, "--workload", "multiturn", "--turns", "2-3", "--system-len", "500",
                 "--user-len", "10-20", "--think-time", "0.5", "--output-len", "32")
    assert isinstance(load, loads.ChatLoad)
    assert (load.spec.turns, load.spec.system_len, load.spec.user_len, load.spec.think_s,
            load.spec.output_len) == ((2, 3), (500, 500), (10, 20), 0.5, 32)
    load = _load(tmp_path, "--workload", "shared-prefix", "--prefixes", "2")
    assert isinstance(load, loads.ChatLoad)
    assert load.spec == chats.ChatSpec("shared-prefix", (1000, 1500), (50, 150), 128, prefixes=2)
    assert "2 system prompts" in load.describe()
    trace = _load(tmp_path, "--workload", "shared-prefix", "--client", "vllm")
    assert isinstance(trace, loads.TraceLoad)
    items = trace.make(20, 1.0, 0)
    assert all(it.prefix >= 0 and it.prefix_len > 0 for it in items)
    mixed = _load(tmp_path)
    assert isinstance(mixed, loads.TraceLoad)
    assert mixed.describe() == workload.describe(workload.MIXED)
    assert [it.cls for it in mixed.make(10, 1.0, 0)] == [
        it.cls for it in workload.make_workload(workload.MIXED, 10, 1.0, 1.0, 0)]


@pytest.mark.parametrize("argv", [
    ("--workload", "multiturn", "--client", "vllm"),  # a trace cannot feed replies back
    ("--workload", "multiturn", "--turns", "6-3"),
    ("--workload", "shared-prefix", "--user-len", "x"),
    ("--workload", "multiturn", "--turns", "10-12"),  # over the model's 4096 positions
])
def test_bad_workload_flags_are_refused(tmp_path: Path, argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _load(tmp_path, *argv)


def test_bench_refuses_a_bad_workload_before_starting_anything(tmp_path: Path) -> None:
    from pdserve.bench.main import main as bench_main

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert bench_main(["--workload", "multiturn", "--model", str(tmp_path),
                       "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
