"""scripts/bench_gemm.py times ours with the executor's launch bounds and weight stages:
the two must agree."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench_gemm.py"
DECODE = ROOT / "vllm_overlay/vllm/models/kimi_linear/sm90/specialized_decode/runtime/decode.py"


def _literal(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} has no module-level {name}")


def test_bench_bounds_are_the_executors():
    executor = _literal(DECODE, "GEMM_MIN_CTAS_BUCKET_16")
    bench = _literal(BENCH, "EXECUTOR_LAUNCH_BOUNDS")
    shapes = _literal(BENCH, "SHAPES")
    assert set(bench) == {"kda_in_qkv_b_fa_ga", "mla_q_proj", "mla_kv_a_proj", "dense_gate_up"}
    assert set(bench) <= set(shapes)
    assert all(bounds == executor for bounds in bench.values())


def test_executor_bounds_the_gemms_the_bench_names():
    # The executor's call sites that take the bounds: in_proj, the fused q / kv_a and the
    # dense gate_up, the weights the bench's four shapes stand for.
    text = DECODE.read_text()
    sites = re.findall(r'"(\w+)",[^)]*min_ctas_per_sm=GEMM_MIN_CTAS_BUCKET_16', text, re.S)
    assert sites == ["kda_in_proj", "mla_qkv_a", "mlp_gate_up"]


def test_bench_weight_stages_are_the_executors():
    executor = _literal(DECODE, "KDA_IN_PROJ_WEIGHT_STAGES")
    bench = _literal(BENCH, "EXECUTOR_WEIGHT_STAGES")
    assert bench == {"kda_in_qkv_b_fa_ga": executor}
    assert set(bench) <= set(_literal(BENCH, "SHAPES"))
