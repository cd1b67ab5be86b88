"""ci/gpu/device_session.sh engine-ab, with a stand-in bench_decode.py (no GPU)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Writes what bench_decode.py's latency_specialized role leaves: the role result in
# --scratch (GPU busy from the switch's value) and an N = 1 trace in --keep-traces
# where the KDA step starts 2 us before in_proj's end and ends 9 us after it.
STAND_IN = r"""
import argparse, gzip, json, os, pathlib
ap = argparse.ArgumentParser()
for a in ("--out-dir", "--scratch", "--runs", "--n", "--roles", "--triton-cache", "--keep-traces"):
    ap.add_argument(a)
ap.add_argument("--decode-only", action="store_true")
ap.add_argument("--model-dir")
ap.add_argument("--routing")
args = ap.parse_args()
assert args.routing == os.environ.get("HD_BENCH_ROUTING", "dummy"), args.routing
if args.model_dir:
    print("model dir:", args.model_dir)
assert args.roles == "latency_specialized" and args.runs == "1"
assert args.n == os.environ.get("HD_AB_N", "1,2")
assert args.decode_only == (os.environ.get("HD_AB_FULL") != "1")
busy = 2000.0 + float(os.environ["HD_SWITCH"])
scratch = pathlib.Path(args.scratch)
scratch.mkdir(parents=True)
(scratch / "latency_specialized.json").write_text(json.dumps(
    {"step_ms": {"1": busy / 1000}, "profile_n1": {"busy_us_per_step": busy}}))
traces = pathlib.Path(args.keep_traces)
traces.mkdir(parents=True, exist_ok=True)
events = [
    {"cat": "kernel", "name": "SkinnyGemmKernel", "ts": 0.0, "dur": 20.0,
     "args": {"grid": [786, 1, 1]}},
    {"cat": "kernel", "name": "KdaDecodeKernel", "ts": 18.0, "dur": 11.0, "args": {}},
]
if "1" in args.n.split(","):
    with gzip.open(traces / "trace-latency_specialized-n1.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
print("latency_specialized N=1: [%.3f] ms" % (busy / 1000))
print("specialized decode: kernel cache %s" % os.environ.get("VLLM_HD_KERNEL_CACHE", "off"))
"""


def _tree_with_stand_in(tmp_path):
    """A checkout with the session script, trace_seams.py and the stand-in
    bench_decode.py, and a PATH whose python3 is this interpreter (the script
    calls python3 by name): (tree, PATH)."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "ci" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "ci/gpu/device_session.sh", tree / "ci/gpu")
    shutil.copy(ROOT / "scripts/trace_seams.py", tree / "scripts")
    config = "tests/runtime/kimi_linear_48b/config.json"
    (tree / config).parent.mkdir(parents=True)
    shutil.copy(ROOT / config, tree / config)
    (tree / "scripts/bench_decode.py").write_text(STAND_IN)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    return tree, f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_engine_ab_runs_the_engine_once_per_value_and_returns_its_numbers(tmp_path):
    tree, path = _tree_with_stand_in(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ, OUT=str(out), HD_AB_DIR=str(tmp_path), PATH=path,
    )  # fmt: skip
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "0", "1"],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "engine HD_SWITCH=0: exit 0" in done.stdout
    assert "GPU busy us per step: {'n1': 2001.0}" in done.stdout
    for tag, busy in (("0", 2000.0), ("1", 2001.0)):
        result = json.loads((out / f"ab-{tag}.json").read_text())
        assert result["profile_n1"]["busy_us_per_step"] == busy
        seams = json.loads((out / f"seams-{tag}.json").read_text())
        assert seams["start_us"]["median"] == -2.0 and seams["end_us"]["median"] == 9.0
    # HD_AB_SEAM names another seam: no kernel precedes the GEMM, so no seams file.
    other_out = tmp_path / "other"
    other_out.mkdir()
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "2"],
        cwd=tree, env=dict(env, OUT=str(other_out), HD_AB_SEAM="--after SkinnyGemm"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert "no 'SkinnyGemm' kernel follows" in done.stderr
    assert (other_out / "ab-2.json").is_file() and not (other_out / "seams-2.json").exists()
    # HD_AB_N without 1: no N = 1 trace, so no seams file and no complaint about it.
    no_n1_out = tmp_path / "no-n1"
    no_n1_out.mkdir()
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "6"],
        cwd=tree, env=dict(env, OUT=str(no_n1_out), HD_AB_N="2,4"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert "engine HD_SWITCH=6: exit 0" in done.stdout and done.stderr == "", done.stderr
    assert (no_n1_out / "ab-6.json").is_file() and not (no_n1_out / "seams-6.json").exists()
    # HD_AB_FULL=1: the whole role run, prefill and host phases included (the stand-in
    # asserts which one it was asked for).
    full = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "3"],
        cwd=tree, env=dict(env, HD_AB_FULL="1"), capture_output=True, text=True,
    )  # fmt: skip
    assert "engine HD_SWITCH=3: exit 0" in full.stdout, full.stderr
    # HD_BENCH_ROUTING=spread: the engines' routers re-drawn as the bench roles' are (the
    # stand-in asserts the regime it was given).
    spread = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "7"],
        cwd=tree, env=dict(env, HD_BENCH_ROUTING="spread"), capture_output=True, text=True,
    )  # fmt: skip
    assert "engine HD_SWITCH=7: exit 0" in spread.stdout, spread.stderr
    # HD_AB_LAYERS=5: the model cut to its first 5 layers, the same config as the
    # end-to-end tests' model; a count the model does not have fails before any engine.
    cut = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "4"],
        cwd=tree, env=dict(env, HD_AB_LAYERS="5"), capture_output=True, text=True,
    )  # fmt: skip
    assert "engine HD_SWITCH=4: exit 0" in cut.stdout, cut.stderr
    model_dir = tmp_path / "hd-ab-model-5"
    assert f"model dir: {model_dir}" in (tmp_path / "hd-ab-4.log").read_text()
    small = ROOT / "tests/integration/kimi_linear_5_layers/config.json"
    assert json.loads((model_dir / "config.json").read_text()) == json.loads(small.read_text())
    too_many = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH", "5"],
        cwd=tree, env=dict(env, HD_AB_LAYERS="28"), capture_output=True, text=True,
    )  # fmt: skip
    assert too_many.returncode == 2 and "the model has 2..27 layers" in too_many.stderr
    assert not (tmp_path / "hd-ab-5.log").exists()
    missing = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "engine-ab", "HD_SWITCH"],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "no value given for HD_SWITCH" in missing.stderr


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")
def test_autotuning_results_are_saved_alone_and_unpacked_on_a_fresh_host(tmp_path):
    """save-autotune archives only the *.autotune.json files of the Triton cache; a
    host without a cache starts from the committed archive, one with a cache keeps it."""
    import tarfile

    tree = tmp_path / "tree"
    (tree / "ci" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "ci/gpu/device_session.sh", tree / "ci/gpu")
    triton = tmp_path / "triton"
    (triton / "a1").mkdir(parents=True)
    (triton / "a1" / "chunk_kda.autotune.json").write_text('{"configs_timings": []}')
    (triton / "a1" / "chunk_kda.cubin").write_bytes(b"\0" * 4096)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), HD_TRITON_DIR=str(triton))

    def session(*args, **extra):
        return subprocess.run(
            ["sh", "ci/gpu/device_session.sh", *args],
            cwd=tree, env=dict(env, **extra), capture_output=True, text=True,
        )  # fmt: skip

    done = session("save-autotune")
    assert done.returncode == 0, done.stderr
    assert "save-autotune: 1 results" in done.stdout
    archive = out / "triton-autotune-h200.tgz"
    with tarfile.open(archive) as saved:
        assert saved.getnames() == ["./a1/chunk_kda.autotune.json"]

    shutil.copy(archive, tree / "ci/gpu")
    fresh = tmp_path / "fresh"
    done = session("save-autotune", HD_TRITON_DIR=str(fresh))
    assert "autotune: 1 results unpacked" in done.stdout
    assert (fresh / "a1" / "chunk_kda.autotune.json").is_file()

    (triton / "a1" / "chunk_kda.autotune.json").unlink()
    done = session("save-autotune")
    assert "unpacked" not in done.stdout
    assert done.returncode == 1 and "no autotuning results" in done.stderr


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_kernel_cache_reaches_the_engines_and_the_saved_caches(tmp_path):
    """HD_KERNEL_CACHE=1 gives every engine VLLM_HD_KERNEL_CACHE=HD_KERNELS_DIR (off
    without it); save-caches packs that directory beside the Triton cache when it
    exists, and the Triton cache alone otherwise."""
    import tarfile

    tree, path = _tree_with_stand_in(tmp_path)
    kernels, triton = tmp_path / "hd-kernels", tmp_path / "triton"
    (triton / "a1").mkdir(parents=True)
    (triton / "a1" / "k.cubin").write_bytes(b"\0")
    env = dict(
        os.environ, HD_AB_DIR=str(tmp_path), HD_KERNELS_DIR=str(kernels),
        HD_TRITON_DIR=str(triton), PATH=path,
    )  # fmt: skip
    env.pop("VLLM_HD_KERNEL_CACHE", None)

    def session(out_name, *args, **extra):
        out = tmp_path / out_name
        out.mkdir()
        done = subprocess.run(
            ["sh", "ci/gpu/device_session.sh", *args],
            cwd=tree, env=dict(env, OUT=str(out), **extra), capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout, out

    stdout, _ = session("off", "engine-ab", "HD_SWITCH", "0")
    assert "specialized decode: kernel cache off" in stdout
    stdout, _ = session("on", "engine-ab", "HD_SWITCH", "0", HD_KERNEL_CACHE="1")
    assert f"specialized decode: kernel cache {kernels}" in stdout

    def saved_names(out):
        parts = sorted(out.glob("caches.tgz.*"))
        (out / "all.tgz").write_bytes(b"".join(p.read_bytes() for p in parts))
        with tarfile.open(out / "all.tgz") as saved:
            return saved.getnames()

    _, out = session("save1", "save-caches")
    assert not any("hd-kernels" in n for n in saved_names(out))
    kernels.mkdir()
    (kernels / "entry.o").write_bytes(b"\0" * 64)
    _, out = session("save2", "save-caches")
    names = saved_names(out)
    assert f"{str(kernels)[1:]}/entry.o" in names and f"{str(triton)[1:]}/a1/k.cubin" in names


# Stands in for profile_prefill.py: one result per engine, and the comparison of two.
PREFILL_STAND_IN = r"""
import argparse, json, pathlib
ap = argparse.ArgumentParser()
ap.add_argument("--compare", nargs=2)
for a in ("--out-dir", "--backend", "--triton-cache"):
    ap.add_argument(a)
args = ap.parse_args()
if args.compare:
    names = [json.loads(pathlib.Path(p).read_text())["backend"] for p in args.compare]
    print("compared " + " -> ".join(names))
else:
    out = pathlib.Path(args.out_dir)
    (out / f"prefill-{args.backend}.json").write_text(json.dumps({"backend": args.backend}))
    print(f"{args.backend}: profiled")
"""


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_prefill_profile_runs_both_engines_then_compares_them(tmp_path):
    tree, path = _tree_with_stand_in(tmp_path)
    (tree / "scripts/profile_prefill.py").write_text(PREFILL_STAND_IN)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "prefill-profile"],
        cwd=tree, env=dict(os.environ, OUT=str(out), PATH=path), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "prefill profile auto: exit 0" in done.stdout
    assert "prefill profile latency_specialized: exit 0" in done.stdout
    assert (out / "prefill-compare.md").read_text() == "compared auto -> latency_specialized\n"
    assert "compared auto -> latency_specialized" in done.stdout


# Records the arguments a bench role ran with, leaves a role result in --scratch and both
# regimes' reports in --out-dir (a host that ran both pairs).
BENCH_ARGS_STAND_IN = r"""
import json, pathlib, sys
args = sys.argv[1:]
scratch = pathlib.Path(args[args.index("--scratch") + 1])
scratch.mkdir(parents=True, exist_ok=True)
(scratch / "auto.json").write_text(json.dumps({"argv": args}))
out = pathlib.Path(args[args.index("--out-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
for stem in ("decode", "decode_spread_routing"):
    (out / f"{stem}.md").write_text(stem)
"""


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
@pytest.mark.parametrize(
    ("env", "routing", "scratch", "n", "layers"),
    [
        ({}, "dummy", "bench", None, None),
        ({"HD_BENCH_ROUTING": "spread", "HD_BENCH_N": "1,2,4"}, "spread", "bench-spread",
         "1,2,4", None),
        ({"HD_BENCH_LAYERS": "5"}, "dummy", "bench-5-layers", None, 5),
    ],
)  # fmt: skip
def test_bench_roles_pass_the_routing_regime_and_keep_its_results_apart(
    tmp_path, env, routing, scratch, n, layers
):
    tree, path = _tree_with_stand_in(tmp_path)
    (tree / "scripts/bench_decode.py").write_text(BENCH_ARGS_STAND_IN)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ, OUT=str(out), PATH=path, HD_TRITON_DIR=str(tmp_path / "t"),
        HD_BENCH_SCRATCH=str(tmp_path / "bench"), HD_BENCH_OUT=str(tmp_path / "bench-out"),
        **env,
    )  # fmt: skip
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "bench-stock"],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert "bench auto,experts: exit 0" in done.stdout, done.stderr
    argv = json.loads((tmp_path / scratch / "auto.json").read_text())["argv"]
    assert argv[argv.index("--routing") + 1] == routing
    assert argv[argv.index("--scratch") + 1] == str(tmp_path / scratch)
    assert (argv[argv.index("--n") + 1] if "--n" in argv else None) == n
    assert json.loads((out / "auto.json").read_text())["argv"] == argv
    # HD_BENCH_LAYERS: the roles run the cut model (the end-to-end tests' 5-layer config).
    if layers is None:
        assert "--model-dir" not in argv
    else:
        model_dir = Path(argv[argv.index("--model-dir") + 1])
        small = ROOT / "tests/integration/kimi_linear_5_layers/config.json"
        assert json.loads((model_dir / "config.json").read_text()) == json.loads(small.read_text())
    # Only this regime's report comes back (the host's out-dir holds both).
    reports = sorted(p.name for p in out.glob("decode*"))
    assert reports == ["decode.md" if routing == "dummy" else "decode_spread_routing.md"]


HANGING_TESTS = """
import time


def test_returns():
    pass


def test_never_returns():
    time.sleep(120)
"""


def _kernel_round(
    tmp_path, jobs: str, gpu_mib: int | None = None
) -> tuple[subprocess.CompletedProcess, str]:
    """kernel-round over HANGING_TESTS with HD_KERNEL_JOBS=jobs: (the run, the log).
    gpu_mib: an nvidia-smi on the PATH that reports a GPU of that much memory."""
    tree, path = _tree_with_stand_in(tmp_path)
    if gpu_mib is not None:
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho {gpu_mib}\n")
        smi.chmod(0o755)
    # python3 as this venv's interpreter by its own path (a symlink elsewhere loses the
    # venv, and with it pytest-timeout).
    python3 = tmp_path / "bin" / "python3"
    python3.unlink()
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    (tree / "tests/kernels").mkdir(parents=True)
    (tree / "tests/kernels/test_stand_in.py").write_text(HANGING_TESTS)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ, OUT=str(out), PATH=path, HD_KERNEL_TEST_S="3", HD_AB_S="5",
        HD_KERNEL_JOBS=jobs,
    )  # fmt: skip
    done = subprocess.run(
        ["sh", "ci/gpu/device_session.sh", "kernel-round", "tests/kernels/test_stand_in.py"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    log = out / "kernel-tests.log"
    return done, log.read_text() if log.exists() else ""


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_kernel_round_names_the_test_that_hangs(tmp_path):
    """A hung kernel test is cut after HD_KERNEL_TEST_S and named in the log, instead
    of the whole round running into its limit with nothing said (2026-12-06: a GPU
    hang behind `| tail` under `timeout` left no output at all)."""
    pytest.importorskip("pytest_timeout")
    done, log = _kernel_round(tmp_path, "1")
    assert "kernel tests: exit 1 " in done.stdout, done.stdout + done.stderr
    assert "test_returns PASSED" in log
    assert "Timeout" in log and "test_never_returns" in log, log


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_kernel_round_spreads_the_tests_over_workers_and_names_a_hang(tmp_path):
    """HD_KERNEL_JOBS=2: two pytest-xdist workers (compiles run one a core); the
    worker cut by the per-test limit is named with its test and replaced, and the
    other tests still pass."""
    pytest.importorskip("pytest_timeout")
    pytest.importorskip("xdist")
    done, log = _kernel_round(tmp_path, "2")
    assert "kernel tests: exit 1 " in done.stdout, done.stdout + done.stderr
    assert "created: 2/2 workers" in log, log
    assert "PASSED tests/kernels/test_stand_in.py::test_returns" in log, log
    named = "crashed while running 'tests/kernels/test_stand_in.py::test_never_returns'"
    assert named in log and named in done.stdout, log


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_kernel_round_takes_no_more_workers_than_the_gpu_memory_holds(tmp_path):
    """A worker per 12 GiB of the GPU at most: on an 80 GB H100 (2026-12-06) 15 workers
    left 107 MoE tests out of memory. A 24 GiB GPU takes 2 of the 8 asked for."""
    pytest.importorskip("pytest_timeout")
    pytest.importorskip("xdist")
    done, log = _kernel_round(tmp_path, "8", gpu_mib=24576)
    assert "8 workers capped at 2 (24576 MiB" in done.stdout, done.stdout + done.stderr
    assert "created: 2/2 workers" in log, log
    assert "PASSED tests/kernels/test_stand_in.py::test_returns" in log, log


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
@pytest.mark.parametrize("jobs", ["0", "many"])
def test_kernel_round_refuses_a_worker_count_that_is_not_a_count(tmp_path, jobs):
    done, log = _kernel_round(tmp_path, jobs)
    assert done.returncode == 2 and not log, done.stdout + done.stderr
    assert f"HD_KERNEL_JOBS={jobs}: expected a count of workers" in done.stderr
