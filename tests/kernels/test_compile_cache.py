# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The on-disk cache of compiled kernels (kernels/common/compile_cache.py).

On the CPU: entries are written once and loaded after, in this process and in
a fresh one; their names change with the key, the kernel and any kernel
source; an entry that does not load is compiled again and replaced; keys that
would differ between processes and unusable directories are refused; every
prepared kernel compiles through the cache. On an SM90 GPU: kernels loaded
from the cache give the compiled kernels' results bit for bit, launched alone
and replayed in a CUDA graph (PDL chain, thread-block cluster launch).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (CuTe DSL) is not installed")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402

from kernels.common import compile_cache  # noqa: E402
from kernels.moe.kernel import MoeCombineKernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, EXPERTS, TOP_K = 2304, 256, 8


def _ptr(dtype):
    # Any 16-byte aligned address: compilation never dereferences it.
    return cute.runtime.make_ptr(dtype, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)


def _combine_args():
    bf16, f32, i32 = (_ptr(t) for t in (cutlass.BFloat16, cutlass.Float32, cutlass.Int32))
    return (f32, i32, f32, bf16, bf16, bf16, bf16, cutlass.Int32(1), cuda.CUstream(0))


def _compile_combine(key=("combine", 1)):
    """The cheapest kernel to compile (~0.6 s), through the cache."""
    kern = MoeCombineKernel(HIDDEN, EXPERTS, TOP_K, 1, True)
    return compile_cache.compile_kernel("test_combine", key, kern, *_combine_args())


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{compile_cache.ENTRY_SUFFIX}"))


@pytest.fixture
def cache_dir(tmp_path):
    """A configured cache in an empty directory, and fresh counters; the cache
    is off again afterwards."""
    saved = compile_cache.STATS
    compile_cache.STATS = compile_cache.CacheStats()
    directory = compile_cache.configure(tmp_path / "kernels")
    yield directory
    compile_cache.configure(None)
    compile_cache.STATS = saved


def test_off_by_default_compiles_and_writes_nothing(tmp_path):
    assert compile_cache.cache_directory() is None
    before = compile_cache.STATS.compiled
    assert _compile_combine() is not None
    assert compile_cache.STATS.compiled == before  # counted only with a cache
    assert list(tmp_path.iterdir()) == []


def test_an_entry_is_written_once_then_loaded(cache_dir):
    first = _compile_combine()
    assert (compile_cache.STATS.compiled, compile_cache.STATS.loaded) == (1, 0)
    [entry] = _entries(cache_dir)
    assert entry.stat().st_size > 0
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".tmp-")]
    second = _compile_combine()
    assert (compile_cache.STATS.compiled, compile_cache.STATS.loaded) == (1, 1)
    assert _entries(cache_dir) == [entry]
    assert type(second) is type(first)


def test_a_fresh_process_loads_what_this_one_wrote(cache_dir):
    """The entry name does not depend on anything of one process (object
    addresses, hash seeds): another interpreter finds the entry and compiles
    nothing."""
    _compile_combine()
    code = (
        "import sys; sys.path.insert(0, 'tests/kernels'); "
        "import test_compile_cache as t; from kernels.common import compile_cache as c; "
        f"c.configure({str(cache_dir)!r}); t._compile_combine(); "
        "print(c.STATS.loaded, c.STATS.compiled, c.STATS.load_failures)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="123")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["1", "0", "0"]


def test_each_key_and_kernel_has_its_own_entry(cache_dir):
    _compile_combine(("combine", 1))
    _compile_combine(("combine", 2))
    assert len(_entries(cache_dir)) == 2
    a = compile_cache.entry_digest("gemm:SkinnyGemmKernel", (1, 2))
    assert a != compile_cache.entry_digest("gemm:SkinnyGemmKernel", (1, 3))
    assert a != compile_cache.entry_digest("kda:KdaDecodeKernel", (1, 2))
    assert a == compile_cache.entry_digest("gemm:SkinnyGemmKernel", (1, 2))


def test_the_entry_names_follow_every_kernel_source(tmp_path):
    root = tmp_path / "pkg"
    (root / "gemm").mkdir(parents=True)
    (root / "gemm" / "kernel.py").write_text("A = 1\n")
    (root / "common.py").write_text("B = 2\n")
    first = compile_cache.source_digest(root)
    (root / "gemm" / "kernel.py").write_text("A = 2\n")
    edited = compile_cache.source_digest(root)
    (root / "gemm" / "notes.txt").write_text("not a source\n")
    assert compile_cache.source_digest(root) == edited
    (root / "moe.py").write_text("")
    added = compile_cache.source_digest(root)
    assert len({first, edited, added}) == 3
    # This package's own digest covers the file that defines the cache.
    assert compile_cache.PACKAGE_ROOT == ROOT / "kernels"


def test_the_cute_dsl_environment_names_the_entries_too(monkeypatch):
    key = ("gemm:SkinnyGemmKernel", (1, 2))
    before = compile_cache.entry_digest(*key)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert compile_cache.entry_digest(*key) != before


def test_an_entry_that_does_not_load_is_compiled_again_and_replaced(cache_dir):
    _compile_combine()
    [entry] = _entries(cache_dir)
    good = entry.read_bytes()
    entry.write_bytes(b"not an object file")
    assert _compile_combine() is not None
    stats = compile_cache.STATS
    assert (stats.load_failures, stats.compiled, stats.loaded) == (1, 2, 0)
    assert entry.read_bytes() == good  # compiles are deterministic
    _compile_combine()
    assert compile_cache.STATS.loaded == 1


def test_a_key_that_prints_an_address_is_refused(cache_dir):
    with pytest.raises(ValueError, match="object address"):
        _compile_combine(("combine", object()))
    assert _entries(cache_dir) == []


def test_unusable_directories_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not absolute"):
        compile_cache.configure("relative/kernels")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=str(blocker / "sub")):
        compile_cache.configure(blocker / "sub")
    assert compile_cache.cache_directory() is None


def test_every_prepared_kernel_compiles_through_the_cache():
    for path in sorted((ROOT / "kernels").glob("*/prepared.py")):
        source = path.read_text()
        assert "cute.compile(" not in source, f"{path}: compiles around the cache"
    assert "compile_kernel(" in (ROOT / "kernels/moe/prepared.py").read_text()


# ------------------------------------------------------------------ on the GPU
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 GPU to launch the loaded kernels",
)


def _fresh_process_caches(monkeypatch):
    """Forget the prepared kernels' in-process compiles, as a new process would."""
    import kernels.gemm.prepared as gemm_prepared
    import kernels.moe.prepared as moe_prepared

    monkeypatch.setattr(gemm_prepared, "_COMPILED", {})
    monkeypatch.setattr(moe_prepared, "_COMPILED", {})


def _run_layer(monkeypatch, inputs):
    """A split-K o_proj (its K reduced through a thread-block cluster) feeding a
    MoE (the router's logits through a 16-CTA cluster, 4 PDL-chained launches,
    the combine adding the residual and normalising), M = 1, freshly bound;
    eagerly, then chained in a CUDA graph replayed 20 times. Both are
    deterministic (no floating-point atomics), so every output can be compared
    bit for bit. Returns every output of both runs."""
    from kernels.gemm.prepared import PreparedGemm
    from kernels.moe.prepared import PreparedMoe

    _fresh_process_caches(monkeypatch)
    w = inputs["moe"]
    moe = PreparedMoe(
        w["gate"], w["bias"], w["w13"], w["w2"], w["shared_gate_up"], w["shared_down"],
        TOP_K, 2.446, rmsnorm_weight=w["gamma"], eps=1e-5,
    )  # fmt: skip
    o_proj = PreparedGemm(inputs["o_proj"])
    assert o_proj.configs[8].split_k > 1 and o_proj.cluster_split_k
    x, residual = inputs["x"], inputs["residual"]
    h, out, residual_out = (torch.empty_like(residual) for _ in range(3))

    def layer():
        o_proj.run(x, h)
        moe.run(h, out, residual, residual_out)

    layer()
    torch.cuda.synchronize()
    eager = [t.clone() for t in (h, out, residual_out, moe.table)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    replays = []
    for _ in range(20):
        for t in (h, out, residual_out):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replays.append([t.clone() for t in (h, out, residual_out)])
    return eager, replays


@needs_sm90
def test_loaded_kernels_give_the_compiled_kernels_results_bit_for_bit(tmp_path, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    inter = 1024
    inputs = {
        "moe": {
            "gate": randn(EXPERTS, HIDDEN, std=HIDDEN**-0.5),
            "bias": 0.1 * torch.randn(EXPERTS, generator=g, device="cuda"),
            "w13": randn(EXPERTS, 2 * inter, HIDDEN, std=HIDDEN**-0.5),
            "w2": randn(EXPERTS, HIDDEN, inter, std=inter**-0.5),
            "shared_gate_up": randn(2 * inter, HIDDEN, std=HIDDEN**-0.5),
            "shared_down": randn(HIDDEN, inter, std=inter**-0.5),
            "gamma": (1.0 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(
                torch.bfloat16
            ),
        },
        "o_proj": randn(HIDDEN, 4096, std=4096**-0.5),
        "x": randn(1, 4096),
        "residual": randn(1, HIDDEN),
    }
    assert compile_cache.cache_directory() is None
    compiled, compiled_replays = _run_layer(monkeypatch, inputs)
    saved = compile_cache.STATS
    compile_cache.STATS = compile_cache.CacheStats()
    try:
        directory = compile_cache.configure(tmp_path / "kernels")
        written, _ = _run_layer(monkeypatch, inputs)
        assert compile_cache.STATS.compiled > 0 and compile_cache.STATS.loaded == 0
        entries = len(_entries(directory))
        assert entries == compile_cache.STATS.compiled
        loaded, loaded_replays = _run_layer(monkeypatch, inputs)
        assert compile_cache.STATS.loaded == entries, "every kernel from the cache"
        assert compile_cache.STATS.compiled == entries and compile_cache.STATS.load_failures == 0
    finally:
        compile_cache.configure(None)
        compile_cache.STATS = saved
    names = ("o_proj out", "moe out", "moe residual", "table")
    for run, results in (("written", written), ("loaded", loaded)):
        for name, got, want in zip(names, results, compiled):
            assert torch.equal(got, want), f"{run}: {name} differs from the compiled kernels'"
    for i, (got, want) in enumerate(zip(loaded_replays, compiled_replays)):
        for name, a, b in zip(names, got, want):
            assert torch.equal(a, b), f"graph replay {i}: {name} differs"
    assert all(torch.equal(a, b) for a, b in zip(loaded_replays[0], compiled[:3]))
