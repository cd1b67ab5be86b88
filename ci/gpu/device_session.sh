#!/bin/sh
# One device call's worth of issue-6 work on the offline H200 host, after the `vllm` gpu-bundle
# (with our wheel) is installed. Every step writes under $OUT (the device tool's return folder,
# at most 8 files come back): big logs go into one archive, a summary goes to stdout.
#
#   sh ci/gpu/device_session.sh e2e      # serve check beside the end-to-end engines, then the
#                                        # judging (~9 min); needs .gpu-bundle/serve carried
#                                        # (HD_E2E_SERVE=0: engines and judging only)
#   sh ci/gpu/device_session.sh bench-stock        # make bench, roles auto + experts (~5 min)
#   sh ci/gpu/device_session.sh bench-specialized  # make bench, role latency_specialized (~5 min)
#   sh ci/gpu/device_session.sh bench-context ROLE  # decode step at 8K / 32K-token contexts
#                                        # (scripts/bench_decode_context.py), ROLE auto or
#                                        # latency_specialized, one per call (~5-6 min each;
#                                        # the second writes decode_context.{json,md})
#   sh ci/gpu/device_session.sh host-loop [BACKEND[:RUNNER]...]  # host time per decode
#                                        # step by phase (scripts/profile_host_loop.py,
#                                        # ~2.5 min per engine), e.g. auto:v2;
#                                        # HD_HOST_LOOP_TOKENS=1024 as make bench
#   sh ci/gpu/device_session.sh prefill-profile     # make bench's prefill batches in the stock
#                                        # and the specialized engine: host ms per step by
#                                        # phase and cProfile, side by side (~6 min;
#                                        # scripts/profile_prefill.py)
#   sh ci/gpu/device_session.sh kernel-round [TEST...]  # GPU kernel tests (default
#                                        # tests/kernels/test_moe.py) then the MoE router's
#                                        # cluster-vs-ticket A/B at HD_AB_M (default every M),
#                                        # each under its own time limit (HD_KERNEL_TESTS_S,
#                                        # HD_AB_S), and each test under HD_KERNEL_TEST_S
#                                        # (default 180; a hang names its test in
#                                        # $OUT/kernel-tests.log), the tests spread over
#                                        # HD_KERNEL_JOBS processes (default 8, pytest-xdist);
#                                        # works in the vllm bundle
#   sh ci/gpu/device_session.sh engine-ab VAR VALUE...  # the specialized engine once per
#                                        # value of the experiment switch VAR (--runs 1, N =
#                                        # HD_AB_N, default 1,2; ~2.5 min per engine with a warm
#                                        # Triton cache, > 4.5 min with a cold one, limit
#                                        # HD_AB_ENGINE_S each, default 560; decode only, no
#                                        # prefill batches or host phases unless HD_AB_FULL=1):
#                                        # its role result
#                                        # (step time, GPU busy per step, kernel table) and the
#                                        # KDA step's start / end against in_proj's end in the
#                                        # N = 1 trace (scripts/trace_seams.py; HD_AB_SEAM holds
#                                        # its arguments for another seam) per value;
#                                        # results stay on the host (HD_AB_DIR, default /tmp),
#                                        # so one value per call works too; HD_AB_LAYERS=N
#                                        # runs the model cut to its first N layers (a GPU
#                                        # of 80 GB: the 48B model needs ~98 GB);
#                                        # HD_BENCH_PROFILE_N=1,2,4,8 traces those N (GPU
#                                        # busy per step; default 1,2)
#   sh ci/gpu/device_session.sh save-caches         # the host's Triton cache (with the
#                                        # autotuning results) and kernel cache (if any) into
#                                        # $OUT in <= 15 MiB pieces; put them in .gpu-cache/
#                                        # and carry it: a fresh host unpacks them first
#   sh ci/gpu/device_session.sh save-autotune        # only Triton's autotuning results
#                                        # (*.autotune.json, a few KB) into
#                                        # $OUT/triton-autotune-h200.tgz: commit it as
#                                        # ci/gpu/triton-autotune-h200.tgz and every fresh
#                                        # host starts with them (run it after an engine ran)
#   sh ci/gpu/device_session.sh upstream-gpu PATH...  # part of upstream's GPU allow-list
#                                        # (ci/upstream_tests.yaml); carry build/upstream-tests
#                                        # and .gpu-bundle/upstream-tests (its test packages:
#                                        # python3 ci/gpu/serve_wheels.py --profile upstream-tests)
#
# HD_KERNEL_CACHE=1 in front of any of these: the engines keep their compiled CuTe DSL kernels
# in HD_KERNELS_DIR (default /tmp/hd-kernels; VLLM_HD_KERNEL_CACHE), so only the first engine
# on a host compiles them (each engine log's "warm-up launches ... took" line says what it
# loaded and compiled). Up to hd.24 the runtime turns the cache off under
# VLLM_DISABLE_COMPILE_CACHE=1, which bench_decode.py's engines set: there it takes a wheel
# with docs/perf/experiments/2026-12-05-kernel-cache-explicit-dir.patch.
#
# The bench roles keep their results in /tmp/hd-bench (same host, back-to-back calls); the
# second one writes decode.{json,md} (with the e2e correctness record when `e2e` ran on this
# host) and both copy what they have to $OUT, with each engine's profiler traces at N = 1
# and 2. Render the plot here: bench_decode.py --render-only --out-dir docs/perf.
# HD_BENCH_ROUTING=spread in front of both bench roles: every engine's MoE routers re-drawn
# so tokens route apart (bench_decode.py --routing spread, scripts/bench_routing.py); results
# in /tmp/hd-bench-spread, report decode_spread_routing.{json,md}. HD_BENCH_N picks the N
# (default every one; spread steps at N = 32 and 64 read ~200 experts a layer and take
# longer: e.g. HD_BENCH_N=1,2,4,8,16). engine-ab takes the same HD_BENCH_ROUTING (its
# engines' routers re-drawn the same way). HD_BENCH_LAYERS=N in front of both bench roles:
# the model cut to its first N layers, as engine-ab's HD_AB_LAYERS (an H100's pair), results
# in /tmp/hd-bench-N-layers and /tmp/hd-bench-out-N-layers.
set -u
: "${OUT:?run on the device host, where OUT is set}"
# Issue 6's method (and make bench's default): the median of 3 runs per N. HD_BENCH_RUNS=1
# for a quick look (2026-12-05's pair of record ran with the old default of 1).
RUNS="${HD_BENCH_RUNS:-3}"
ROUTING="${HD_BENCH_ROUTING:-dummy}"
E2E=/tmp/hd-integ
SCRATCH="${HD_BENCH_SCRATCH:-/tmp/hd-bench}"
BENCH_OUT="${HD_BENCH_OUT:-/tmp/hd-bench-out}"
REPORT=decode  # bench_decode.py's REPORT_STEMS
if [ "$ROUTING" != dummy ]; then
    SCRATCH="$SCRATCH-$ROUTING"
    REPORT="decode_${ROUTING}_routing"
fi
if [ -n "${HD_BENCH_LAYERS:-}" ]; then
    # A cut model's roles and report are kept apart from the whole model's on this host.
    SCRATCH="$SCRATCH-$HD_BENCH_LAYERS-layers"
    BENCH_OUT="$BENCH_OUT-$HD_BENCH_LAYERS-layers"
fi
TRITON="${HD_TRITON_DIR:-/tmp/hd-triton}"
AUTOTUNE_ARCHIVE=triton-autotune-h200.tgz
# Autotuning results go into the Triton cache too: a fresh host given it (.gpu-cache/, from
# save-caches) skips the KDA prefill autotuning at the first prefill (2026-12-01: engine start
# ~200 -> ~80 s for the specialized engine, ~30 s for stock). CuTe DSL 4.6.0 keeps no file
# cache of our cute.compile calls: their compiles run at every engine start unless
# HD_KERNEL_CACHE=1 (the kernel cache, saved and unpacked with the Triton cache).
export TRITON_CACHE_AUTOTUNING=1
KERNELS="${HD_KERNELS_DIR:-/tmp/hd-kernels}"
if [ "${HD_KERNEL_CACHE:-0}" = 1 ]; then
    export VLLM_HD_KERNEL_CACHE="$KERNELS"
fi
if ls .gpu-cache/caches.tgz.* > /dev/null 2>&1 && [ ! -d "$TRITON" ]; then
    cat .gpu-cache/caches.tgz.* | tar xzf - -C / && echo "caches: unpacked .gpu-cache"
fi
# Without a whole cache, the committed autotuning results alone: the first prefill then
# compiles only the chosen configs instead of timing every one (on 2026-12-03 a cold host's
# first engine took 499 s, the next one 150 s). Results of another Triton or kernel source
# have other keys and are never looked up.
if [ -f "ci/gpu/$AUTOTUNE_ARCHIVE" ] && [ ! -d "$TRITON" ]; then
    mkdir -p "$TRITON" && tar xzf "ci/gpu/$AUTOTUNE_ARCHIVE" -C "$TRITON" \
        && echo "autotune: $(find "$TRITON" -name '*.autotune.json' | wc -l) results unpacked"
fi

# The model cut to its first $1 layers into folder $2, by the rule of tests/integration's
# 5-layer model, for a GPU that cannot hold the 48B model (an H100's 80 GB; it needs ~98 GB);
# $3 names the variable that asked, for the error.
cut_model() {
    python3 - "$1" "$2" "$3" <<'CUT'
import json, pathlib, sys
n, out, asked_by = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
config = json.loads(pathlib.Path("tests/runtime/kimi_linear_48b/config.json").read_text())
if not 2 <= n <= config["num_hidden_layers"]:
    sys.exit(f"{asked_by}={n}: the model has 2..{config['num_hidden_layers']} layers")
linear = config["linear_attn_config"]
mla = [i for i in linear["full_attn_layers"] if i <= n]
config["num_hidden_layers"] = n
linear["full_attn_layers"] = mla
linear["kda_layers"] = [i for i in range(1, n + 1) if i not in mla]
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps(config, indent=2))
CUT
}

bench_role() {
    correctness=""
    [ -f "$E2E/correctness.json" ] && correctness="--correctness $E2E/correctness.json"
    model_dir=""
    if [ -n "${HD_BENCH_LAYERS:-}" ]; then
        model_dir="$SCRATCH-model"
        cut_model "$HD_BENCH_LAYERS" "$model_dir" HD_BENCH_LAYERS || exit 2
        correctness=""  # the end-to-end record is the whole model's, not this one's
    fi
    # shellcheck disable=SC2086
    timeout 570 python3 scripts/bench_decode.py --out-dir "$BENCH_OUT" \
        --scratch "$SCRATCH" --runs "$RUNS" --roles "$1" --triton-cache "$TRITON" \
        --routing "$ROUTING" ${HD_BENCH_N:+--n "$HD_BENCH_N"} \
        ${model_dir:+--model-dir "$model_dir"} \
        --keep-traces "$OUT" $correctness > "/tmp/hd-bench-$1.log" 2>&1
    echo "bench $1: exit $?"
    grep -v "Autotuning kernel" "/tmp/hd-bench-$1.log" \
        | grep -E " N=|rror|Traceback|specialized decode:|init engine" | tail -20
    grep -v "Autotuning kernel" "/tmp/hd-bench-$1.log" | tail -c 2000000 \
        | gzip > "$OUT/bench-$(echo "$1" | tr , _).log.gz"  # no "," in returned names
    # The role results while the report is incomplete; the report once every role ran
    # (bench_decode.py then empties the scratch folder).
    cp "$SCRATCH"/*.json "$BENCH_OUT/$REPORT".* "$OUT"/ 2>/dev/null
}

case "${1:-}" in
e2e)
    if [ -f .gpu-bundle/serve/install.sh ]; then
        sh .gpu-bundle/serve/install.sh
    fi
    mkdir -p /tmp/hd-serve "$E2E"
    # HD_E2E_SERVE=0 leaves the serve check out (its engine shares the GPU and the call).
    if [ "${HD_E2E_SERVE:-1}" != 0 ]; then
        (timeout 540 python3 scripts/check_serve.py --out-dir /tmp/hd-serve \
            > /tmp/hd-serve/check.out 2>&1; echo "check_serve exit $?" >> /tmp/hd-serve/check.out) &
    fi
    HD_TRITON_CACHE_DIR="$TRITON" timeout 450 python3 tests/integration/engine_runs.py \
        --dir "$E2E" stock specialized auto > "$E2E/runs.out" 2>&1
    echo "engine_runs: exit $?"; tail -c 2500 "$E2E/runs.out"
    HD_INTEGRATION_DIR="$E2E" HD_INTEGRATION_REUSE=1 timeout 120 \
        python3 -m pytest tests/integration -m gpu -rs -q -s -p no:cacheprovider \
        > "$E2E/pytest.log" 2>&1
    echo "pytest: exit $?"; grep -E "^batch|min cos|passed|failed" "$E2E/pytest.log" | tail -20
    wait
    tail -c 1500 /tmp/hd-serve/check.out 2>/dev/null
    for d in "$E2E"/*/; do
        [ -f "$d/engine.log" ] && grep -v "Autotuning kernel" "$d/engine.log" \
            | tail -c 300000 > "$d/engine.filtered.log"
    done
    cp "$E2E/correctness.json" /tmp/hd-serve/serve_check.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/e2e.tgz" "$E2E"/*/session.json "$E2E"/*/engine.filtered.log \
        "$E2E"/runs.out "$E2E"/pytest.log /tmp/hd-serve 2>/dev/null
    ;;
bench-stock)
    bench_role auto,experts
    ;;
bench-specialized)
    bench_role latency_specialized
    ;;
bench-context)
    role="${2:?bench-context needs a role: auto or latency_specialized}"
    mkdir -p /tmp/hd-context
    timeout 570 python3 scripts/bench_decode_context.py --out-dir /tmp/hd-context \
        --roles "$role" --triton-cache "$TRITON" > "/tmp/hd-context-$role.log" 2>&1
    echo "bench-context $role: exit $?"
    grep -v "Autotuning kernel" "/tmp/hd-context-$role.log" \
        | grep -E "context=|rror|Traceback|specialized decode:|init engine|wrote" | tail -20
    grep -v "Autotuning kernel" "/tmp/hd-context-$role.log" | tail -c 2000000 \
        | gzip > "$OUT/bench-context-$role.log.gz"
    cp /tmp/hd-context/*.json /tmp/hd-context/*.md "$OUT"/ 2>/dev/null
    ;;
host-loop)
    # Host time per decode step by phase, unprofiled, then cProfile (~2.5 min per engine);
    # engines as BACKEND[:RUNNER], default the specialized and the stock one on runner v1.
    shift
    [ $# -gt 0 ] || set -- latency_specialized auto
    for engine in "$@"; do
        backend="${engine%%:*}"
        runner=v1
        [ "$engine" != "$backend" ] && runner="${engine#*:}"
        timeout "${HD_HOST_LOOP_S:-480}" python3 scripts/profile_host_loop.py --out-dir "$OUT" \
            --backend "$backend" --runner "$runner" --triton-cache "$TRITON" \
            --tokens "${HD_HOST_LOOP_TOKENS:-256}" \
            > "/tmp/hd-host-$engine.log" 2>&1
        echo "host loop $engine: exit $?"
        grep -v "Autotuning kernel" "/tmp/hd-host-$engine.log" | tail -40
    done
    ;;
prefill-profile)
    # Host time of make bench's prefill batches by phase, then cProfile of three more, for
    # the stock and the specialized engine, and the two side by side (~3 min per engine;
    # scripts/profile_prefill.py). Outputs in $OUT; the comparison on stdout too.
    for backend in auto latency_specialized; do
        timeout "${HD_PREFILL_PROFILE_S:-400}" python3 scripts/profile_prefill.py \
            --out-dir "$OUT" --backend "$backend" --triton-cache "$TRITON" \
            > "/tmp/hd-prefill-$backend.log" 2>&1
        echo "prefill profile $backend: exit $?"
        grep -v "Autotuning kernel" "/tmp/hd-prefill-$backend.log" | tail -20
    done
    python3 scripts/profile_prefill.py --compare "$OUT/prefill-auto.json" \
        "$OUT/prefill-latency_specialized.json" > "$OUT/prefill-compare.md" 2>&1
    head -c 6000 "$OUT/prefill-compare.md"
    ;;
kernel-round)
    shift
    [ $# -gt 0 ] || set -- tests/kernels/test_moe.py
    # A kernel that hangs blocks its test inside a CUDA call, where no signal reaches
    # Python: pytest-timeout's thread method prints the hung test's stack and ends the run
    # after HD_KERNEL_TEST_S seconds of one test, so the log names it.
    per_test=""
    if python3 -c "import pytest_timeout" 2>/dev/null; then
        per_test="--timeout=${HD_KERNEL_TEST_S:-180} --timeout-method=thread"
    else
        echo "kernel tests: no pytest-timeout here, so a hang is cut only by HD_KERNEL_TESTS_S"
    fi
    # The tests' time on a fresh host is mostly CuTe DSL compiles, one CPU core each
    # (2026-12-06: 21 MoE tests took 400 s): HD_KERNEL_JOBS pytest-xdist workers (on the
    # device image; default 8 of its 16 cores, 1: one process) share the GPU. A worker
    # cut by the per-test limit is named ("crashed while running ...") and replaced,
    # so the other tests still run. The workers share the GPU's memory too: a MoE test
    # worker holds ~11 GiB (2026-12-06, an 80 GB H100: 15 workers, 107 tests out of
    # memory), so at most one worker per 12 GiB of the GPU.
    jobs="${HD_KERNEL_JOBS:-8}"
    case "$jobs" in
        '' | *[!0-9]* | 0) echo "HD_KERNEL_JOBS=$jobs: expected a count of workers (1 or more)" >&2
            exit 2 ;;
    esac
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
        | head -1 | tr -d ' ')
    case "$gpu_mib" in
        '' | *[!0-9]*) ;;  # no nvidia-smi answer: no cap
        *)
            fit=$((gpu_mib / 1024 / 12))
            [ "$fit" -ge 1 ] || fit=1
            if [ "$jobs" -gt "$fit" ]; then
                echo "kernel tests: $jobs workers capped at $fit ($gpu_mib MiB of GPU memory, 12 GiB a worker)"
                jobs=$fit
            fi
            ;;
    esac
    workers=""
    if [ "$jobs" != 1 ]; then
        if python3 -c "import xdist" 2>/dev/null; then
            workers="-n $jobs"
        else
            echo "kernel tests: no pytest-xdist here, so one process runs them"
        fi
    fi
    # shellcheck disable=SC2086  # per_test and workers are two words or none
    PYTHONUNBUFFERED=1 timeout "${HD_KERNEL_TESTS_S:-300}" python3 -m pytest -v -rfEs \
        $workers $per_test "$@" > "$OUT/kernel-tests.log" 2>&1
    echo "kernel tests: exit $? (124: cut by HD_KERNEL_TESTS_S)"
    grep -E "^(FAILED|ERROR)|Timeout|crashed while running|passed|failed" \
        "$OUT/kernel-tests.log" | tail -8
    timeout "${HD_AB_S:-240}" python3 scripts/ab_router_cluster.py --out "$OUT/ab" \
        --m "${HD_AB_M:-1,2,4,8,16}" > "$OUT/ab_router_cluster.log" 2>&1
    echo "ab_router_cluster: exit $?"
    grep -v '^{' "$OUT/ab_router_cluster.log" | tail -40
    ;;
engine-ab)
    var="${2:?engine-ab needs a switch name and values, e.g. VLLM_HD_MOE_FOLD_COMBINE 0 1}"
    shift 2
    [ $# -gt 0 ] || { echo "engine-ab: no value given for $var" >&2; exit 2; }
    ab="${HD_AB_DIR:-/tmp}/hd-ab"
    seam="${HD_AB_SEAM:---after KdaDecode --before SkinnyGemm --before-grid 786,1,1}"
    # The A/B reads the decode's step time and GPU busy: the prefill batches and host
    # phases of a full run (~11 prefill batches, 4 more decode batches) are left out.
    decode_only=--decode-only
    [ "${HD_AB_FULL:-0}" = 1 ] && decode_only=""
    model_dir=""
    if [ -n "${HD_AB_LAYERS:-}" ]; then
        model_dir="$ab-model-$HD_AB_LAYERS"
        cut_model "$HD_AB_LAYERS" "$model_dir" HD_AB_LAYERS || exit 2
    fi
    for value in "$@"; do
        tag=$(echo "$value" | tr -c 'A-Za-z0-9_.\n-' _)  # returned names: no odd characters
        [ -n "$tag" ] || tag=empty
        rm -rf "$ab-$tag"
        # 560 s: the first engine on a fresh host autotunes the KDA prefill kernels; on
        # 2026-12-03 a 290 s limit cut it, and the next engine (cache partly filled) took 279 s.
        # shellcheck disable=SC2086
        env "$var=$value" timeout "${HD_AB_ENGINE_S:-560}" python3 scripts/bench_decode.py \
            --out-dir "$ab-out-$tag" --scratch "$ab-$tag" --runs 1 \
            --n "${HD_AB_N:-1,2}" --roles latency_specialized --triton-cache "$TRITON" \
            --routing "$ROUTING" --keep-traces "$ab-traces-$tag" $decode_only \
            ${model_dir:+--model-dir "$model_dir"} > "$ab-$tag.log" 2>&1
        echo "engine $var=$value: exit $?"
        grep -v "Autotuning kernel" "$ab-$tag.log" \
            | grep -E " N=|rror|Traceback|specialized decode:" | tail -8
        cp "$ab-$tag/latency_specialized.json" "$OUT/ab-$tag.json" 2>/dev/null \
            && python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
print('GPU busy us per step:', {k[-2:]: round(v['busy_us_per_step'], 1) \
for k, v in d.items() if k.startswith('profile_n') and v}); \
print('GPU busy us, median step:', {k[-2:]: v.get('busy_us_median_step') \
and round(v['busy_us_median_step'], 1) for k, v in d.items() \
if k.startswith('profile_n') and v})" "$OUT/ab-$tag.json"
        # The seam is read in the N = 1 trace, which an HD_AB_N without 1 does not make.
        seam_trace="$ab-traces-$tag/trace-latency_specialized-n1.json.gz"
        if [ -f "$seam_trace" ]; then
            # shellcheck disable=SC2086
            python3 scripts/trace_seams.py "$seam_trace" $seam --json "$OUT/seams-$tag.json"
        fi
    done
    ;;
save-caches)
    if [ -d "$KERNELS" ]; then
        tar czf /tmp/hd-caches.tgz -C / "${TRITON#/}" "${KERNELS#/}"
    else
        tar czf /tmp/hd-caches.tgz -C / "${TRITON#/}"
    fi
    split -b 15m -d /tmp/hd-caches.tgz "$OUT/caches.tgz."
    du -sh "$TRITON" /tmp/hd-caches.tgz
    if [ -d "$KERNELS" ]; then du -sh "$KERNELS"; fi
    ;;
save-autotune)
    found=$( (cd "$TRITON" 2>/dev/null && find . -name '*.autotune.json') | sort)
    [ -n "$found" ] || { echo "save-autotune: no autotuning results in $TRITON" >&2; exit 1; }
    # shellcheck disable=SC2086
    (cd "$TRITON" && tar czf "$OUT/$AUTOTUNE_ARCHIVE" $found)
    size=$(wc -c < "$OUT/$AUTOTUNE_ARCHIVE")
    echo "save-autotune: $(echo "$found" | wc -l) results, $size bytes in \$OUT/$AUTOTUNE_ARCHIVE"
    # It travels with every device call (64 MiB with a 60 MiB bundle part).
    [ "$size" -le 1048576 ] || echo "save-autotune: over 1 MiB, too big to commit" >&2
    ;;
upstream-gpu)
    shift
    if [ -f .gpu-bundle/upstream-tests/install.sh ]; then
        sh .gpu-bundle/upstream-tests/install.sh
    fi
    parts=""
    for path in "$@"; do parts="$parts --only $path"; done
    # The session ends itself (and reports what ran) well inside the call's limit; the log
    # goes straight to $OUT so that it comes back even if the call is cut. On 2026-12-01
    # tests/kernels/test_kda.py alone ran ~45 s per test (Triton compiles): pass few paths.
    # shellcheck disable=SC2086
    timeout 570 python3 scripts/hd.py upstream-tests --python python3 --subset gpu \
        --extracted --session-timeout "${HD_UPSTREAM_SESSION_S:-420}" $parts \
        > "$OUT/upstream-gpu.log" 2>&1
    echo "upstream-tests: exit $?"
    grep -E "^upstream-tests|passed|failed" "$OUT/upstream-gpu.log" | tail -12
    # The device tool returns no file whose name holds a "+" (the report names join the
    # test files with it).
    for report in build/upstream-tests-gpu*.json; do
        [ -f "$report" ] && cp "$report" "$OUT/$(basename "$report" | tr '+' '_')"
    done
    ;;
*)
    echo "usage: sh ci/gpu/device_session.sh e2e|bench-stock|bench-specialized|bench-context ROLE|host-loop|kernel-round [TEST...]|engine-ab VAR VALUE...|save-caches|save-autotune|upstream-gpu" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
