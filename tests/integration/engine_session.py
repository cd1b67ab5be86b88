"""Run one vLLM engine of the end-to-end tests and write what it did to a folder.

    python engine_session.py --kind {stock,auto,specialized,unsupported} --out DIR
                             [--forced-from STOCK_DIR]

One engine per process: two vLLM engines in one process share global state (distributed
groups, compilation config, the forward context), and a fresh process gives the GPU memory
back. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the
test), so an exception at engine start arrives here as raised (a ValueError stays a
ValueError) and collective_rpc callables reach the live model runner without serialization.

Writes DIR/session.json (status "ok" | "start_failed" | "run_failed", the exception chain,
the engine description, timings) and DIR/<scenario>.pt per scenario of scenarios.SCENARIOS.
With --forced-from, the compare and auto scenarios force every request onto the tokens that the
stock engine produced (STOCK_DIR/<scenario>.tokens.json), so both engines decode the same
sequences; the stock engine may still be running (engine_runs.py starts them at once): such a
scenario waits for its tokens, and fails if the stock session failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import scenarios as sc

# How long a teacher-forced scenario waits for the stock engine's tokens.
FORCED_TOKENS_WAIT_S = 900
STOCK_FAILED = ("start_failed", "run_failed")


def wait_for_forced_tokens(path: Path, timeout_s: float = FORCED_TOKENS_WAIT_S) -> Any:
    """The stock run's tokens at ``path`` (STOCK_DIR/<scenario>.tokens.json), waiting while
    the stock engine is still running; raises if it failed or never wrote them."""
    status_file = path.parent / "session.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        try:
            status = json.loads(status_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet
            status = {}
        if status.get("status") in STOCK_FAILED or status.get("status") == "ok":
            raise RuntimeError(
                f"the stock run in {path.parent} ended ({status['status']}) without "
                f"writing {path.name}: run the stock engine first"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"no stock tokens at {path} after {timeout_s:.0f} s")
        time.sleep(2)
    return json.loads(path.read_text())


def write_atomically(path: Path, text: str) -> None:
    """A concurrent teacher-forced run polls the stock run's files: never show it half
    of one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def exception_chain(exc: BaseException) -> list[list[str]]:
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append([type(current).__name__, str(current)])
        current = current.__cause__ or current.__context__
    return chain


def build_engine(kind: str) -> Any:
    import kimi_decode_hooks  # registers the seeded load format

    from vllm import LLM

    return LLM(
        logits_processors=[kimi_decode_hooks.StepRecorder],
        **sc.ENGINE_ARGS,
        **sc.ENGINE_KINDS[kind],
    )


def sampling_params(request: sc.Request, forced: list[int] | None = None) -> Any:
    from kimi_decode_hooks import FORCED_KEY, TAG_KEY

    from vllm import SamplingParams

    extra: dict[str, Any] = {TAG_KEY: request.tag}
    if forced is not None:
        extra[FORCED_KEY] = forced
    return SamplingParams(
        temperature=0.0,
        max_tokens=request.max_tokens,
        ignore_eos=True,
        detokenize=False,
        extra_args=extra,
    )


def prompt(request: sc.Request) -> dict[str, Any]:
    return {"prompt_token_ids": list(request.prompt)}


class Session:
    def __init__(self, llm: Any, recorder: Any, out: Path, forced_from: Path | None):
        self.llm, self.recorder, self.out, self.forced_from = llm, recorder, out, forced_from

    def generate(
        self, requests: list[sc.Request], forced: dict[str, list[int]] | None = None
    ) -> dict[str, list[int]]:
        outputs = self.llm.generate(
            [prompt(r) for r in requests],
            [sampling_params(r, (forced or {}).get(r.tag)) for r in requests],
            use_tqdm=False,
        )
        return {r.tag: list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)}

    def record(self, requests: list[sc.Request], tokens: dict[str, list[int]]) -> dict:
        for r in requests:
            if len(tokens[r.tag]) != r.max_tokens:
                raise RuntimeError(f"{r.tag}: {len(tokens[r.tag])} tokens, not {r.max_tokens}")
        record = self.recorder.take(
            [r.tag for r in requests], {r.tag: r.max_tokens for r in requests}
        )
        record["tokens"] = tokens
        record["prompts"] = {r.tag: list(r.prompt) for r in requests}
        return record

    def compare(self, batch: int) -> dict:
        """Batch `batch` through prefill + 256 decode steps, then the states."""
        from kimi_decode_hooks import read_request_states

        requests = sc.compare_requests(batch)
        forced = None
        if self.forced_from is not None:
            path = self.forced_from / f"{sc.compare_scenario(batch)}.tokens.json"
            forced = wait_for_forced_tokens(path)
        record = self.record(requests, self.generate(requests, forced))
        # The last sampled token is never fed back: prompt + max_tokens - 1 cached tokens.
        cached = {r.tag: len(r.prompt) + r.max_tokens - 1 for r in requests}
        [record["states"]] = self.llm.collective_rpc(
            read_request_states, args=(record["block_ids"], cached)
        )
        record["forced"] = forced is not None
        return record

    def auto_check(self) -> dict:
        requests = sc.auto_requests()
        forced = None
        if self.forced_from is not None:
            forced = wait_for_forced_tokens(self.forced_from / f"{sc.AUTO_SCENARIO}.tokens.json")
        record = self.record(requests, self.generate(requests, forced))
        record["forced"] = forced is not None
        return record

    def alone(self) -> dict:
        requests = sc.mixed_requests()
        tokens: dict[str, list[int]] = {}
        for r in requests:
            tokens.update(self.generate([r]))
        return self.record(requests, tokens)

    def mixed(self) -> dict:
        """Requests join a running batch at their arrival step (engine.step() calls)."""
        requests = sc.mixed_requests()
        pending = sorted(requests, key=lambda r: r.arrive_at_step)
        engine = self.llm.llm_engine
        tag_of: dict[str, str] = {}
        tokens: dict[str, list[int]] = {}
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].arrive_at_step <= step:
                r = pending.pop(0)
                [request_id] = self.llm.enqueue([prompt(r)], [sampling_params(r)], use_tqdm=False)
                # enqueue returns the engine's internal id ("<id>-<8 random chars>",
                # InputProcessor.assign_request_id); step() outputs carry the given id.
                tag_of[request_id] = tag_of[request_id.rpartition("-")[0]] = r.tag
            if engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        tokens[tag_of[output.request_id]] = list(output.outputs[0].token_ids)
            step += 1
            if step > 20_000:
                raise RuntimeError("mixed traffic did not finish in 20000 engine steps")
        record = self.record(requests, tokens)
        record["engine_steps"] = step
        return record

    def run(self, scenario: str) -> dict:
        if scenario.startswith("compare_b"):
            return self.compare(int(scenario.removeprefix("compare_b")))
        return {
            sc.AUTO_SCENARIO: self.auto_check,
            sc.MIXED_SCENARIO: self.mixed,
            sc.ALONE_SCENARIO: self.alone,
        }[scenario]()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(sc.ENGINE_KINDS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--forced-from", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    status: dict[str, Any] = {
        "kind": args.kind,
        "status": "starting",
        "forced_from": args.forced_from and str(args.forced_from),
        "seconds": {},
    }

    def write_status() -> None:
        write_atomically(args.out / "session.json", json.dumps(status, indent=2))

    write_status()
    started = time.perf_counter()
    try:
        llm = build_engine(args.kind)
    except BaseException as exc:  # the tests judge what engine start raised
        status.update(
            status="start_failed",
            error=exception_chain(exc),
            traceback=traceback.format_exc(),
        )
        status["seconds"]["engine_start"] = round(time.perf_counter() - started, 1)
        write_status()
        return 3
    status["seconds"]["engine_start"] = round(time.perf_counter() - started, 1)
    if shared_triton_cache := os.environ.get("HD_TRITON_CACHE_DIR"):
        # Set by engine_runs.py: one autotuning cache for every engine kind (vLLM named
        # the folder after this engine's compile hash at start; Triton reads it per use).
        os.environ["TRITON_CACHE_DIR"] = shared_triton_cache

    try:
        import torch
        from kimi_decode_hooks import attach_recorder, describe_engine

        [recorder] = llm.collective_rpc(attach_recorder)
        [status["engine"]] = llm.collective_rpc(describe_engine)
        session = Session(llm, recorder, args.out, args.forced_from)
        for scenario in sc.SCENARIOS[args.kind]:
            t0 = time.perf_counter()
            record = session.run(scenario)
            torch.save(record, args.out / f"{scenario}.pt")
            # The tokens alone, for --forced-from (no need to load the logits).
            write_atomically(args.out / f"{scenario}.tokens.json", json.dumps(record["tokens"]))
            status["seconds"][scenario] = round(time.perf_counter() - t0, 1)
            write_status()
    except BaseException as exc:
        status.update(
            status="run_failed", error=exception_chain(exc), traceback=traceback.format_exc()
        )
        write_status()
        return 4
    status["status"] = "ok"
    write_status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
