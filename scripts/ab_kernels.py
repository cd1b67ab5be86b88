#!/usr/bin/env python3
"""A/B one kernel family of this tree against the same family at another revision.

Two steps, because the GPU host has no git:

    python3 scripts/ab_kernels.py stage --base HEAD~1      # here: writes build/ab-base/
    python3 scripts/ab_kernels.py moe|kda|gemm --out DIR   # on the H200, carry build/ab-base

`stage` exports `kernels/` of the base revision as the package `kernels_base` under
build/ab-base/ (git-ignored; ~0.2 MB, carry it in the device call). The run builds both
variants on the same weights and caches, checks that they agree, and times them in one
process, interleaved (base, new, base, new, ...), with the bench scripts' own CUDA-graph
methods (`bench_moe.time_graph`, `bench_kda.time_graph`, `bench_gemm._time_graph`). It
prints one JSON line per case and writes DIR/ab_<family>.json. A throw-away experiment
can thus be measured against the tree it would replace without a second staging.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE_DIR = ROOT / "build" / "ab-base"
ROUNDS = 3


def stage(base: str, stage_dir: Path = STAGE_DIR) -> int:
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{base}^{{commit}}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if rev.returncode:
        print(f"error: {base!r} is not a commit of this repository", file=sys.stderr)
        return 2
    target = stage_dir / "kernels_base"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev.stdout.strip(), "kernels"],
        capture_output=True, check=True,
    )  # fmt: skip
    subprocess.run(
        ["tar", "-x", "-C", str(target), "--strip-components=1"],
        input=archive.stdout, check=True,
    )  # fmt: skip
    (stage_dir / "REVISION").write_text(rev.stdout)
    print(f"staged kernels/ of {rev.stdout.strip()[:12]} as {target}; carry {stage_dir}")
    return 0


# ----------------------------------------------- shared by the one-change A/B scripts
# (ab_split_reduce.py, ab_router_cluster.py: two variants of one tree in one process)


def bits_equal(a, b) -> bool:
    """Whether two tensors hold the same bits (bf16 and FP32 compared as integers,
    so NaNs and signed zeros count too)."""
    import torch

    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(a.dtype)
    if bits is not None:
        a, b = a.view(bits), b.view(bits)
    return bool(torch.equal(a, b))


def ab_parser(doc: str, json_name: str, m_default: str) -> argparse.ArgumentParser:
    """The script's parser (its docstring as help) with ``--out DIR`` and ``--m``."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0],
        epilog=doc.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help=f"writes DIR/{json_name}"
    )
    parser.add_argument("--m", default=m_default, help=f"token counts (default {m_default})")
    return parser


def layered_ab_parser(
    doc: str, json_name: str, m_default: str, subset: str, choices, layers: int,
    reps: int, replays: int,
) -> argparse.ArgumentParser:  # fmt: skip
    """``ab_parser`` plus ``--<subset>`` (comma-separated names of ``choices``, all
    by default) and bench_moe's graph method: ``--layers``, ``--reps``, ``--replays``."""
    parser = ab_parser(doc, json_name, m_default)
    parser.add_argument(
        f"--{subset}",
        default=",".join(choices),
        help=f"comma-separated subset of {', '.join(choices)} (default: all)",
    )
    parser.add_argument("--layers", type=int, default=layers, help="distinct layers per graph")
    parser.add_argument("--reps", type=int, default=reps, help="repetitions per graph")
    parser.add_argument("--replays", type=int, default=replays, help="timed graph replays")
    return parser


def parsed_layered_ab_args(parser, subset: str, choices, what: str):
    """(args, the chosen ``subset`` names, the token counts); usage errors exit 2."""
    args = parser.parse_args()
    names = parsed_subset(parser, getattr(args, subset), choices, what)
    return args, names, parsed_token_counts(parser, args.m)


def layered_probe_main(
    doc: str, json_name: str, script: str, m_default: str, variants, layers: int,
    reps: int, replays: int, run, table, what: str,
) -> int:  # fmt: skip
    """A layered probe's command line: parse ``--variants`` and bench_moe's graph
    method, refuse a host without an SM90 GPU, ``run(m_values, variants, layers,
    reps, replays)`` -> rows, print ``table(rows, variants)`` and write the report."""
    parser = layered_ab_parser(
        doc, json_name, m_default, "variants", variants, layers, reps, replays
    )
    args, chosen, m_values = parsed_layered_ab_args(parser, "variants", variants, "variant")
    missing = sm90_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    rows = run(m_values, chosen, args.layers, args.reps, args.replays)
    print(table(rows, chosen))
    fields = {"what": what, "layers": args.layers, "reps": args.reps, "replays": args.replays}
    write_report(args.out, json_name, script, fields, rows)
    return 0


def variant_table(rows, variants, lead: tuple, diff_key: str, legend: str, width: int) -> str:
    """µs per row and variant, ``row[diff_key][variant]`` in brackets where present;
    ``lead``: the (row key, column width) pairs that name a row."""
    names = " ".join(f"{key:>{w}s}" for key, w in lead)
    lines = [names + " " + " ".join(f"{v:>{width}s}" for v in variants)]
    for r in rows:
        cells = []
        for v in variants:
            diff = r.get(diff_key, {}).get(v)
            extra = "" if diff is None else f" ({diff:+.2f})"
            cells.append(f"{r['us'][v]:.2f}{extra}".rjust(width))
        lines.append(" ".join(f"{r[key]!s:>{w}s}" for key, w in lead) + " " + " ".join(cells))
    lines.append(legend)
    return "\n".join(lines)


def parsed_subset(parser, text: str, choices, what: str) -> list[str]:
    """``text``'s comma-separated names, each one of ``choices`` (else a usage error)."""
    names = text.split(",")
    unknown = [n for n in names if n not in choices]
    if unknown:
        parser.error(f"unknown {what}(s) {unknown}; expected some of {list(choices)}")
    return names


def parsed_token_counts(parser, text: str) -> list[int]:
    """``--m``'s token counts, each in the kernels' 1..16."""
    m_values = [int(m) for m in text.split(",")]
    if not all(1 <= m <= 16 for m in m_values):
        parser.error(f"--m values must lie in 1..16, got {m_values}")
    return m_values


def sm90_missing() -> str | None:
    """Why this host cannot run the A/B (None on an SM90 GPU)."""
    import torch

    if not torch.cuda.is_available():
        return "needs an SM90 GPU (H200); CUDA is not available here"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an SM90 GPU, found {torch.cuda.get_device_name()}"
    return None


def write_report(out_dir: Path, json_name: str, script: str, fields: dict, rows) -> None:
    """DIR/json_name: ``fields`` with the GPU, date and command of this run, then ``rows``."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        **fields,
        "gpu": torch.cuda.get_device_name(),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python3 scripts/{script} " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    (out_dir / json_name).write_text(json.dumps(report, indent=1) + "\n")


def _agree(what: str, got, ref, limit: float) -> float:
    """Normwise relative difference of the new variant's output from the base's; refuses
    to time two variants that do not compute the same thing."""
    rel = float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
    if not rel <= limit:
        raise SystemExit(f"{what}: new and base disagree (rel {rel:.2e} > {limit:g}); not timing")
    return rel


def _interleaved(timer, launch_base, launch_new) -> dict:
    """``timer(launch)``: µs per call of ``launch`` (one CUDA-graph method)."""
    runs = {"base": [], "new": []}
    for _ in range(ROUNDS):
        runs["base"].append(timer(launch_base))
        runs["new"].append(timer(launch_new))
    base, new = statistics.median(runs["base"]), statistics.median(runs["new"])
    return {"base_us": base, "new_us": new, "new_over_base": new / base, "runs_us": runs}


def ab_moe(gen, m_values=None) -> list[dict]:
    import torch
    from kernels_base.moe.prepared import PreparedMoe as BaseMoe

    import bench_moe as bm

    def timer_for(layers):
        return lambda launch: bm.time_graph(launch, layers, 4, 20)[0]

    rows = []
    for regime in bm.REGIMES:
        layers = [bm.Layer(regime, gen, None) for _ in range(4)]
        for lay in layers:
            lay.base = BaseMoe(
                lay.gate, lay.bias, lay.w13, lay.w2, lay.shared_gate_up, lay.shared_down,
                bm.TOP_K, bm.SCALE,
            )  # fmt: skip
        for m in m_values or bm.M_VALUES:
            x = torch.randn(m, bm.HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            out_b, out_n = (torch.empty(m, bm.HIDDEN, dtype=x.dtype, device="cuda") for _ in "bn")
            layers[0].base.run(x, out_b)
            layers[0].moe.run(x, out_n)
            torch.cuda.synchronize()
            row = {
                "regime": regime, "m": m, "bit_equal": bool(torch.equal(out_b, out_n)),
                "rel_diff": _agree(f"moe {regime} M={m}", out_n, out_b, 2e-2),
            }  # fmt: skip
            row |= _interleaved(
                timer_for(layers),
                lambda lay, x=x, out=out_b: lay.base.run(x, out),
                lambda lay, x=x, out=out_n: lay.moe.run(x, out),
            )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        del layers
        torch.cuda.empty_cache()
    return rows


# The KDA step's variants, each timed against the base's same variant: the plain kernel,
# the one that loads its slot, state and conv history before the PDL wait, and the
# decode executor's (that, with f_b / g_b applied inside: inputs f_a(x), g_a(x)).
KDA_VARIANTS = ("prepared", "prepared_early", "prepared_low_rank")


def ab_kda(gen) -> list[dict]:
    import torch
    from kernels_base.kda.prepared import PreparedKda as BaseKda

    import bench_kda as bk

    def timer_for(layers):
        return lambda launch: bk.time_graph(launch, layers, 15)[0]

    rows = []
    for batch in bk.BATCHES:
        state_b, _ = bk.layer_bytes(batch)
        n_layers = min(bk.MAX_LAYERS, max(2, -(-3 * bk.L2_BYTES // state_b)))
        layers = [bk.Layer(batch, gen) for _ in range(n_layers)]
        for lay in layers:
            common = (
                tuple(w.view(bk.PROJ, 1, 4) for w in lay.conv_weight), lay.a_log,
                lay.dt_bias, lay.norm_weight, lay.conv_state, lay.state,
            )  # fmt: skip
            lay.base = {
                "prepared": BaseKda(*common, num_heads=bk.HEADS),
                "prepared_early": BaseKda(
                    *common, num_heads=bk.HEADS, state_loads_before_wait=True
                ),
                "prepared_low_rank": BaseKda(
                    *common, num_heads=bk.HEADS, state_loads_before_wait=True,
                    gate_weights=lay.gate_weights,
                ),
            }  # fmt: skip
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
        q, k, v, g1, g2 = (rnd(batch, bk.PROJ) for _ in range(5))
        f_a, g_a = (rnd(batch, bk.GATE_RANK) for _ in range(2))
        beta = rnd(batch, bk.HEADS)
        slots = torch.arange(1, batch + 1, device="cuda", dtype=torch.int32)
        out = torch.empty(batch, bk.PROJ, device="cuda", dtype=torch.bfloat16)
        steps = {
            name: (q, k, v, f_a, beta, g_a, slots, out)
            if name == "prepared_low_rank"
            else (q, k, v, g1, beta, g2, slots, out)
            for name in KDA_VARIANTS
        }
        row = {"batch": batch, "layers_in_graph": n_layers}
        # One step of each side of each variant from the same caches (restored after each).
        lay = layers[0]
        conv0, state0 = lay.conv_state.clone(), lay.state.clone()
        for name in KDA_VARIANTS:
            results = []
            for prepared in (lay.base[name], getattr(lay, name)):
                lay.conv_state.copy_(conv0)
                lay.state.copy_(state0)
                prepared.run(*steps[name])
                torch.cuda.synchronize()
                results.append((out.clone(), lay.state.clone()))
            (base_out, base_state), (new_out, new_state) = results
            row[f"{name}_rel_diff"] = {
                "out": _agree(f"kda {name} B={batch} out", new_out, base_out, 5e-3),
                "state": _agree(f"kda {name} B={batch} state", new_state, base_state, 1e-4),
            }
        lay.conv_state.copy_(conv0)
        lay.state.copy_(state0)
        for name in KDA_VARIANTS:
            row[name] = _interleaved(
                timer_for(layers),
                lambda lay, a=steps[name], n=name: lay.base[n].run(*a),
                lambda lay, a=steps[name], n=name: getattr(lay, n).run(*a),
            )
        rows.append(row)
        print(json.dumps({"batch": batch, **{
            n: {k: v for k, v in row[n].items() if k != "runs_us"} for n in KDA_VARIANTS
        }}), flush=True)  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    return rows


def ab_gemm(gen) -> list[dict]:
    import torch
    from kernels_base.gemm.prepared import PreparedGemm as BaseGemm

    import bench_gemm as bg
    from kernels.gemm.prepared import PreparedGemm

    def timer_for(copies):
        # One launch per weight copy, all in one graph (the copies span > L2).
        return lambda launch: bg._time_graph([lambda c=c: launch(c) for c in copies])[0]

    rows = []
    for name, (n, k, epilogue, _) in bg.SHAPES.items():
        if name == "lm_head":  # cuBLAS in the decode; the GEMM A/B is the layers' shapes
            continue
        copies = max(2, min(bg.MAX_COPIES, -(-2 * bg.L2_BYTES // (n * k * 2))))
        weights = [
            torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * k**-0.5
            for _ in range(copies)
        ]
        extra = {}
        if epilogue == "residual_rmsnorm":
            extra["rmsnorm_weight"] = torch.ones(n, device="cuda", dtype=torch.bfloat16)
        base = [BaseGemm(w, epilogue, **extra) for w in weights]
        new = [PreparedGemm(w, epilogue, **extra) for w in weights]
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            cols = n // 2 if epilogue == "silu_mul" else n
            out = torch.empty(m, cols, device="cuda", dtype=torch.bfloat16)
            args = ()
            if epilogue == "residual_rmsnorm":
                residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
                args = (residual, torch.empty_like(residual))
            call = (x, out, *args)
            ref = base[0].run(*call).clone()
            got = new[0].run(*call).clone()
            row = {
                "shape": name, "m": m, "epilogue": epilogue,
                "rel_diff": _agree(f"gemm {name} M={m}", got, ref, 1e-2),
            }  # fmt: skip
            row |= _interleaved(
                timer_for(range(copies)),
                lambda c, a=call, ps=base: ps[c].run(*a),
                lambda c, a=call, ps=new: ps[c].run(*a),
            )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs_us"}), flush=True)
        del weights, base, new
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stage", help="export kernels/ of a revision to build/ab-base/")
    st.add_argument("--base", required=True, help="a git revision, e.g. HEAD~1")
    st.add_argument("--dir", type=Path, default=STAGE_DIR)
    for family in ("moe", "kda", "gemm"):
        sp = sub.add_parser(family, help=f"time {family}: base vs this tree (on an SM90 GPU)")
        sp.add_argument("--out", type=Path, required=True)
        sp.add_argument("--dir", type=Path, default=STAGE_DIR)
        if family == "moe":
            sp.add_argument("--m", help="comma-separated token counts (default: bench_moe's)")
    args = ap.parse_args()
    if args.cmd == "stage":
        return stage(args.base, args.dir)
    if not (args.dir / "kernels_base").is_dir():
        print(f"error: no {args.dir}/kernels_base: run `stage --base REV` first and "
              "carry that folder", file=sys.stderr)  # fmt: skip
        return 2
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: needs an SM90 GPU", file=sys.stderr)
        return 2
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(args.dir)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.cmd == "moe" and args.m:
        rows = ab_moe(gen, [int(m) for m in args.m.split(",")])
    else:
        rows = {"moe": ab_moe, "kda": ab_kda, "gemm": ab_gemm}[args.cmd](gen)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "family": args.cmd,
        "base": (args.dir / "REVISION").read_text().strip(),
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "rows": rows,
    }
    (args.out / f"ab_{args.cmd}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
