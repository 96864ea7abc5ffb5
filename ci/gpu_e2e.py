"""End to end on a GPU: ``sglang.launch_server`` with and without the storage tier.

Called by ``ci/gpu_e2e.sh`` inside a venv with the full SGLang 0.5.23, this repository
installed and its patches applied. Two commands:

- ``build-model DIR`` - a tiny Llama with random weights (bf16, 2 layers) and a BPE
  tokenizer trained on the prompt vocabulary, saved where ``--model-path`` can load it;
  built locally, nothing downloaded. The weights are drawn with a large ``initializer_range``
  so the next-token logits are peaked: greedy decoding then does not flip on rounding
  differences between a prefix that was recomputed and one that was loaded.
- ``run --model DIR --workdir DIR`` - serves one multi-turn conversation three times:

  1. ``baseline``: no ``--storage-*`` flag;
  2. ``storage``: ``--storage-backend file`` (write-through, root under ``--workdir``);
  3. ``restart``: a fresh server on the same storage root, same requests.

  Between turns every run waits for the writes to settle and calls ``/flush_cache``, so a
  turn's prefix can only come from storage (device and host tiers are empty). It asserts
  (a) greedy outputs identical in all three runs, (b) storage hits on every turn after the
  first in ``storage``, (c) storage hits from the first turn on in ``restart``; and prints
  the time to first token per run. Exit status 0 when every assertion holds.

Storage hits are read from each response's ``meta_info``: ``cached_tokens_details["storage"]``
where SGLang reports it, else ``cached_tokens`` (after a flush, and in a fresh server, every
cached token came from storage). The Prometheus counter
``sglang:cached_tokens_total{cache_source="storage"}`` is printed too when ``/metrics``
serves it. The pure parts (prompt building, SSE and metrics parsing, hit accounting, the
comparison) are unit-tested on CPU: ``tests/unit/test_gpu_e2e.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS_SEED = 1234
VOCAB_WORDS = 600
TURNS = 3
MAX_NEW_TOKENS = 24
PAGE_SIZE = 16
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 300.0
TIE_NATS = 0.05
SETTLE_S = float(os.environ.get("E2E_SETTLE_S", "3"))


# ---------------------------------------------------------------------- pure parts


def say(text: str = "") -> None:
    """Print ``text`` and flush (the log is read while the check runs)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def vocabulary(n: int = VOCAB_WORDS, seed: int = WORDS_SEED) -> list[str]:
    """``n`` distinct made-up lowercase words, the same for a given seed."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))] = None
    return list(words)


def user_messages(turns: int = TURNS, words_per_turn: int = 120, seed: int = 7) -> list[str]:
    """The user's message per turn: long enough to span many KV pages."""
    rng = random.Random(seed)
    vocab = vocabulary()
    return [" ".join(rng.choice(vocab) for _ in range(words_per_turn)) for _ in range(turns)]


def turn_prompt(messages: Sequence[str], replies: Sequence[str]) -> str:
    """The prompt of turn ``len(replies)``: every earlier exchange, then the next message.

    Each turn's prompt starts with the previous turn's prompt and reply, so its prefix is
    what the previous turn cached.
    """
    if len(replies) >= len(messages):
        raise ValueError(f"{len(replies)} replies leave no message to send ({len(messages)})")
    parts = []
    for message, reply in zip(messages, replies, strict=False):
        parts.append(f"User: {message}\nAssistant:{reply}\n")
    parts.append(f"User: {messages[len(replies)]}\nAssistant:")
    return "".join(parts)


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (``data: {...}``), up to ``[DONE]``."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text exposition as ``{(name, labels): value}`` (comments skipped)."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            name, _, rest = head.partition("{")
            labels = []
            for item in rest.rstrip("}").split(","):
                if "=" in item:
                    key, _, val = item.partition("=")
                    labels.append((key.strip(), val.strip().strip('"')))
            key_labels = frozenset(labels)
        else:
            name, key_labels = head, frozenset()
        try:
            out[(name.strip(), key_labels)] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(
    metrics: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= ls)


def storage_hit_tokens(meta: dict[str, Any], *, cold: bool) -> int:
    """Prompt tokens a response says came from storage.

    ``cached_tokens_details["storage"]`` where SGLang reports it; else, when ``cold`` (the
    device and host tiers were empty: after a flush or in a fresh server), every cached
    token; else 0.
    """
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict) and "storage" in details:
        return int(details["storage"] or 0)
    return int(meta.get("cached_tokens") or 0) if cold else 0


@dataclass
class Turn:
    """One request's outcome."""

    prompt: str
    text: str
    ttft_s: float
    cached_tokens: int
    storage_tokens: int
    token_ids: list[int] = field(default_factory=list)
    top2_gaps: list[float] = field(default_factory=list)


def output_tokens(meta: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The generated token ids and, per position, the top-1 minus top-2 logprob.

    Read from ``output_token_logprobs`` (``[logprob, token_id, text]`` per token) and
    ``output_top_logprobs`` (a list of those per token); empty where absent.
    """
    ids = [int(entry[1]) for entry in meta.get("output_token_logprobs") or []]
    gaps = []
    for top in meta.get("output_top_logprobs") or []:
        ranked = sorted((float(e[0]) for e in top or []), reverse=True)
        gaps.append(ranked[0] - ranked[1] if len(ranked) > 1 else float("inf"))
    return ids, gaps


def compare_turn(base: Turn, other: Turn, tie_nats: float = TIE_NATS) -> tuple[str, str]:
    """Whether ``other`` generated what ``base`` did: ``("same" | "tie" | "differs", detail)``.

    Token ids are compared where both have them, else the texts. A first difference where
    the baseline's top two candidates were within ``tie_nats`` of each other is a ``tie``:
    rounding may pick either, so it is reported, not failed.
    """
    if base.token_ids and other.token_ids:
        for k, (a, b) in enumerate(zip(base.token_ids, other.token_ids, strict=False)):
            if a != b:
                gap = base.top2_gaps[k] if k < len(base.top2_gaps) else float("inf")
                verdict = "tie" if gap < tie_nats else "differs"
                return verdict, f"token {k}: {b} != {a} (baseline top-2 gap {gap:.4f} nats)"
        if len(base.token_ids) != len(other.token_ids):
            return "differs", f"{len(other.token_ids)} tokens != {len(base.token_ids)}"
        return "same", ""
    if base.text == other.text:
        return "same", ""
    return "differs", f"{other.text[:80]!r} != {base.text[:80]!r}"


@dataclass
class Run:
    """One server's conversation."""

    name: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def replies(self) -> list[str]:
        """The generated text per turn."""
        return [t.text for t in self.turns]

    def median_ttft_ms(self, first: int = 0) -> float:
        """Median time to first token over turns ``first..``, in milliseconds."""
        values = [t.ttft_s for t in self.turns[first:]]
        return statistics.median(values) * 1e3 if values else float("nan")


def check_runs(baseline: Run, storage: Run, restart: Run) -> list[str]:
    """Every assertion of the end-to-end check that fails, as messages (empty: all hold)."""
    problems = []
    for other in (storage, restart):
        if len(other.turns) != len(baseline.turns):
            problems.append(
                f"(a) {other.name} has {len(other.turns)} turns, not {len(baseline.turns)}"
            )
        for i, (base, turn) in enumerate(zip(baseline.turns, other.turns, strict=False)):
            verdict, detail = compare_turn(base, turn)
            if verdict == "differs":
                problems.append(f"(a) {other.name} turn {i} differs from baseline: {detail}")
            elif verdict == "tie":
                say(f"note: {other.name} turn {i}: a near-tie resolved differently: {detail}")
    for i, turn in enumerate(storage.turns[1:], start=1):
        if turn.storage_tokens <= 0:
            problems.append(f"(b) storage turn {i}: no storage hit (cached {turn.cached_tokens})")
    for i, turn in enumerate(restart.turns):
        if turn.storage_tokens <= 0:
            problems.append(f"(c) restart turn {i}: not served from storage")
    return problems


def ttft_table(runs: Sequence[Run]) -> str:
    """Per-turn and median time to first token of each run, as text."""
    lines = ["run        " + "".join(f"turn {i:<6}" for i in range(TURNS)) + "median(1..)"]
    for run in runs:
        cells = "".join(f"{t.ttft_s * 1e3:8.1f}ms " for t in run.turns)
        lines.append(f"{run.name:<11}{cells}{run.median_ttft_ms(1):8.1f}ms")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the model


def build_model(out: Path) -> None:
    """Save a tiny random Llama and a matching tokenizer into ``out`` (nothing downloaded)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(  # type: ignore[no-untyped-call]
        vocab_size=2000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(vocabulary()), *user_messages(), "User: Assistant:\n"]
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    vocab_size = ((len(fast) + 63) // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.3,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    model.save_pretrained(out)


# ---------------------------------------------------------------------- the server


class Server:
    """One ``python -m sglang.launch_server`` process, its log in ``log``."""

    def __init__(self, args: Sequence[str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        command = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        say("$ " + " ".join(command))
        with log.open("wb") as sink:
            self._proc = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SystemExit(f"server exited with {self._proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        self.stop()
        raise SystemExit(f"server not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        """The end of the server log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, prompt: str) -> tuple[str, float, dict[str, Any]]:
        """Greedy-decode ``prompt`` (streamed); the text, time to first token and meta_info."""
        body = {
            "text": prompt,
            "stream": True,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": MAX_NEW_TOKENS,
                "ignore_eos": True,
            },
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        request = urllib.request.Request(
            f"{self.url}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        ttft = None
        last: dict[str, Any] = {}
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            for event in sse_events(response):
                if ttft is None:
                    ttft = time.perf_counter() - started
                last = event  # streamed text is cumulative (SGLang's default)
        if ttft is None:
            raise SystemExit(f"no streamed output for a request:\n{self.tail()}")
        return str(last.get("text", "")), ttft, dict(last.get("meta_info", {}))

    def flush(self) -> None:
        """Empty the device and host caches (``/flush_cache``), retrying while busy."""
        for _ in range(30):
            request = urllib.request.Request(f"{self.url}/flush_cache", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=60) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"/flush_cache kept failing:\n{self.tail()}")

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The server's Prometheus metrics (empty where ``/metrics`` is not served)."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
                return parse_metrics(r.read().decode())
        except (urllib.error.URLError, OSError):
            return {}

    def stop(self) -> None:
        """Stop the server and everything it started."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=30)


def converse(
    server: Server, name: str, messages: Sequence[str], replies: Sequence[str] | None
) -> Run:
    """Send the conversation turn by turn, flushing the caches between turns.

    Turn ``i``'s prompt holds the earlier messages and ``replies`` (the baseline's, so every
    run sends the same requests), or this run's own replies where ``replies`` is None.
    """
    run = Run(name)
    for i in range(len(messages)):
        if i:
            time.sleep(SETTLE_S)  # let write-through reach storage
            server.flush()
        prompt = turn_prompt(messages, (run.replies if replies is None else replies)[:i])
        text, ttft, meta = server.generate(prompt)
        ids, gaps = output_tokens(meta)
        turn = Turn(
            prompt=prompt,
            text=text,
            ttft_s=ttft,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            storage_tokens=storage_hit_tokens(meta, cold=True),  # flushed, or a fresh server
            token_ids=ids,
            top2_gaps=gaps,
        )
        say(
            f"{name} turn {i}: ttft {ttft * 1e3:.1f} ms, cached {turn.cached_tokens}, "
            f"storage {turn.storage_tokens}, details {meta.get('cached_tokens_details')}"
        )
        run.turns.append(turn)
    hits = metric_sum(server.metrics(), "sglang:cached_tokens_total", cache_source="storage")
    say(f"{name}: sglang:cached_tokens_total{{cache_source=storage}} = {hits:.0f}")
    return run


def serve(
    args: Sequence[str],
    port: int,
    log: Path,
    name: str,
    messages: Sequence[str],
    replies: Sequence[str] | None = None,
) -> Run:
    """Start a server, run the conversation on it, stop it."""
    server = Server(args, port, log)
    try:
        return converse(server, name, messages, replies)
    finally:
        server.stop()


def run_all(model: str, workdir: Path, port: int, extra: Sequence[str]) -> int:
    """The three runs and the assertions; 0 when every assertion holds."""
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / "storage-root"
    shutil.rmtree(root, ignore_errors=True)  # the storage run starts from an empty tier
    common = [
        "--model-path",
        model,
        "--page-size",
        str(PAGE_SIZE),
        "--mem-fraction-static",
        "0.3",
        "--random-seed",
        "0",
        "--enable-metrics",
        *extra,
    ]
    storage = [
        "--storage-backend",
        "file",
        "--storage-backend-config",
        json.dumps({"root": str(root)}),
        "--storage-host-memory",
        "2GB",
        "--storage-write-policy",
        "write_through",
        "--storage-prefetch-threshold",
        str(PAGE_SIZE),
    ]
    messages = user_messages()
    baseline = serve(common, port, workdir / "server-baseline.log", "baseline", messages)
    same = baseline.replies  # every later run sends the baseline's requests
    with_storage = serve(
        [*common, *storage], port, workdir / "server-storage.log", "storage", messages, same
    )
    stored = sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    say(f"files under the storage root: {stored}")
    restart = serve(
        [*common, *storage], port, workdir / "server-restart.log", "restart", messages, same
    )
    runs = [baseline, with_storage, restart]
    say("\nTime to first token (turn 0 cold everywhere except restart):")
    say(ttft_table(runs))
    report = {
        r.name: [
            {"ttft_ms": t.ttft_s * 1e3, "cached": t.cached_tokens, "storage": t.storage_tokens}
            for t in r.turns
        ]
        for r in runs
    }
    (workdir / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    problems = check_runs(baseline, with_storage, restart)
    if stored == 0:
        problems.append(f"(b) the storage run wrote nothing under {root}")
    for problem in problems:
        say(f"FAIL {problem}")
    say("e2e: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``build-model DIR`` or ``run --model M --workdir W``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model", help="save a tiny random Llama + tokenizer")
    build.add_argument("out", type=Path)
    run = sub.add_parser("run", help="the three server runs and the assertions")
    run.add_argument("--model", required=True, help="a model directory or hub name")
    run.add_argument("--workdir", type=Path, required=True)
    run.add_argument("--port", type=int, default=30000)
    run.add_argument("server_args", nargs="*", help="more launch_server arguments (after --)")
    args = parser.parse_args(argv)
    if args.command == "build-model":
        build_model(args.out)
        say(f"tiny model saved in {args.out}")
        return 0
    return run_all(args.model, args.workdir, args.port, args.server_args)


if __name__ == "__main__":
    sys.exit(main())
