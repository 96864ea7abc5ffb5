"""The CPU-testable parts of ``ci/gpu_e2e.py`` (the GPU end-to-end driver).

The server runs need a GPU and the full SGLang; what runs here is everything that decides
a verdict: prompts, stream and metrics parsing, storage-hit accounting, the output
comparison, the argument plumbing, and the tiny model (built, then loaded and run with
transformers on CPU).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "gpu_e2e.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_e2e", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_e2e"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


e2e = load()


def turn(text: str = "x", storage: int = 0, ids: list[int] | None = None, gaps: Any = None) -> Any:
    return e2e.Turn(
        prompt="p",
        text=text,
        ttft_s=0.01,
        cached_tokens=storage,
        storage_tokens=storage,
        token_ids=ids or [],
        top2_gaps=gaps or [],
    )


def run(name: str, *turns: Any) -> Any:
    return e2e.Run(name, list(turns))


def test_vocabulary_and_messages_are_deterministic() -> None:
    words = e2e.vocabulary()
    assert len(words) == len(set(words)) == e2e.VOCAB_WORDS
    assert words == e2e.vocabulary()
    messages = e2e.user_messages()
    assert len(messages) == e2e.TURNS
    assert messages == e2e.user_messages()
    assert all(len(m.split()) == 120 for m in messages)


def test_each_turn_prompt_extends_the_previous_one() -> None:
    messages = ["alpha beta", "gamma", "delta"]
    first = e2e.turn_prompt(messages, [])
    second = e2e.turn_prompt(messages, [" one two"])
    third = e2e.turn_prompt(messages, [" one two", " three"])
    assert first == "User: alpha beta\nAssistant:"
    assert second.startswith(first + " one two\n")
    assert third.startswith(second + " three\n")
    assert third.endswith("User: delta\nAssistant:")
    with pytest.raises(ValueError, match="no message"):
        e2e.turn_prompt(messages, ["a", "b", "c"])


def test_sse_events_stop_at_done() -> None:
    lines = [
        b'data: {"text": "a"}\n',
        b"\n",
        b": keep-alive\n",
        b'data: {"text": "ab", "meta_info": {"cached_tokens": 3}}\n',
        b"data: [DONE]\n",
        b'data: {"text": "never"}\n',
    ]
    events = list(e2e.sse_events(lines))
    assert [ev["text"] for ev in events] == ["a", "ab"]
    assert events[-1]["meta_info"]["cached_tokens"] == 3


def test_metrics_are_parsed_and_summed_by_label() -> None:
    text = "\n".join(
        [
            "# HELP sglang:cached_tokens_total cached",
            "# TYPE sglang:cached_tokens_total counter",
            'sglang:cached_tokens_total{cache_source="storage",model_name="m"} 48.0',
            'sglang:cached_tokens_total{cache_source="device",model_name="m"} 16.0',
            'sglang:cached_tokens_total{cache_source="storage",model_name="n"} 2.0',
            "sglang:num_requests_total 5",
            "garbage line without a number x",
        ]
    )
    metrics = e2e.parse_metrics(text)
    assert e2e.metric_sum(metrics, "sglang:cached_tokens_total", cache_source="storage") == 50.0
    assert e2e.metric_sum(metrics, "sglang:cached_tokens_total") == 66.0
    assert e2e.metric_sum(metrics, "sglang:num_requests_total") == 5.0
    assert e2e.metric_sum(metrics, "sglang:absent") == 0.0


def test_storage_hits_come_from_details_or_a_cold_cache() -> None:
    details = {"cached_tokens": 64, "cached_tokens_details": {"device": 16, "storage": 48}}
    assert e2e.storage_hit_tokens(details, cold=False) == 48
    assert e2e.storage_hit_tokens(details, cold=True) == 48
    no_storage_field = {"cached_tokens": 64, "cached_tokens_details": {"device": 64}}
    assert e2e.storage_hit_tokens(no_storage_field, cold=True) == 64
    assert e2e.storage_hit_tokens(no_storage_field, cold=False) == 0
    assert e2e.storage_hit_tokens({"cached_tokens": 0}, cold=True) == 0
    assert e2e.storage_hit_tokens({}, cold=True) == 0


def test_output_tokens_and_top2_gaps() -> None:
    meta = {
        "output_token_logprobs": [[-0.1, 7, None], [-0.5, 9, None]],
        "output_top_logprobs": [
            [[-0.1, 7, None], [-2.1, 3, None]],
            [[-0.7, 4, None], [-0.5, 9, None]],  # order is not assumed
        ],
    }
    ids, gaps = e2e.output_tokens(meta)
    assert ids == [7, 9]
    assert gaps == pytest.approx([2.0, 0.2])
    assert e2e.output_tokens({}) == ([], [])


def test_compare_turn_tells_same_tie_and_difference() -> None:
    base = turn(ids=[1, 2, 3], gaps=[1.0, 0.01, 1.0])
    assert e2e.compare_turn(base, turn(ids=[1, 2, 3]))[0] == "same"
    assert e2e.compare_turn(base, turn(ids=[1, 5, 3]))[0] == "tie"  # gap 0.01 < 0.05
    verdict, detail = e2e.compare_turn(base, turn(ids=[9, 2, 3]))
    assert verdict == "differs"
    assert "token 0" in detail
    assert e2e.compare_turn(base, turn(ids=[1, 2]))[0] == "differs"
    assert e2e.compare_turn(turn("abc"), turn("abc"))[0] == "same"  # no ids: the texts
    assert e2e.compare_turn(turn("abc"), turn("abd"))[0] == "differs"


def test_check_runs_accepts_a_good_set_and_names_each_failure() -> None:
    baseline = run("baseline", turn("a"), turn("b"), turn("c"))
    storage = run("storage", turn("a"), turn("b", 32), turn("c", 48))
    restart = run("restart", turn("a", 16), turn("b", 48), turn("c", 64))
    assert e2e.check_runs(baseline, storage, restart) == []

    storage_miss = run("storage", turn("a"), turn("b", 0), turn("c", 48))
    restart_bad = run("restart", turn("a", 0), turn("X", 48), turn("c", 64))
    problems = e2e.check_runs(baseline, storage_miss, restart_bad)
    assert any(p.startswith("(b) storage turn 1") for p in problems)
    assert any(p.startswith("(c) restart turn 0") for p in problems)
    assert any(p.startswith("(a) restart turn 1") for p in problems)
    assert len(problems) == 3
    short = run("storage", turn("a"), turn("b", 32))
    assert any("has 2 turns" in p for p in e2e.check_runs(baseline, short, restart))


def test_ttft_table_has_a_row_per_run() -> None:
    table = e2e.ttft_table([run("baseline", turn(), turn(), turn()), run("storage", turn())])
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("baseline")
    assert "10.0ms" in lines[1]


def test_main_passes_server_arguments_after_the_separator(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def fake_run_all(model: str, workdir: Path, port: int, extra: list[str]) -> int:
        """A stand-in for the GPU server runs (they cannot run here)."""
        seen.append((model, workdir, port, extra))
        return 0

    monkeypatch.setattr(e2e, "run_all", fake_run_all)
    argv = ["run", "--model", "m", "--workdir", "/w", "--port", "31000", "--", "--tp", "2"]
    assert e2e.main(argv) == 0
    assert seen == [("m", Path("/w"), 31000, ["--tp", "2"])]


def test_tiny_model_loads_and_decodes_greedily(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch = pytest.importorskip("torch")
    e2e.build_model(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tiny")
    assert config["vocab_size"] >= len(tokenizer)
    messages = e2e.user_messages()
    first = e2e.turn_prompt(messages, [])
    second = e2e.turn_prompt(messages, [" some reply"])
    ids_first = tokenizer(first).input_ids
    ids_second = tokenizer(second).input_ids
    assert tokenizer.decode(ids_first) == first  # text round-trips
    assert ids_second[: len(ids_first)] == ids_first  # a turn's tokens extend the last one's
    assert len(ids_first) > 4 * e2e.PAGE_SIZE  # spans several KV pages
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    inputs = torch.tensor([ids_first])
    outputs = [
        model.generate(inputs, max_new_tokens=4, do_sample=False)[0, len(ids_first) :].tolist()
        for _ in range(2)
    ]
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 4
