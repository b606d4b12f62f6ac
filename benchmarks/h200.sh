#!/usr/bin/env bash
# The H200 measurements of the production-scale work, one part per device call (each under 10 minutes),
# run from the project root after `source .gpu/setup.sh` (../shared/gpu/README.md). Results go to $OUT
# (default: benchmarks/results/h200-run). Parts share /root/models between calls on the same machine.
#   bash benchmarks/h200.sh tests     IPC exact-KL test, Compare-vs-Diagnostics verdict test, 1.1B compare speed
#   bash benchmarks/h200.sh rollout   rollout cost against the bare path, and its noise floors
#   bash benchmarks/h200.sh again     the 1.1B compare speed again, and where the rollout's HF side spends its time
#   bash benchmarks/h200.sh 8b        8B shape: a 32,000-token text (GPU test), compare speed
#   bash benchmarks/h200.sh set       8B shape: 1,000 x 2,048 tokens with the exact KL
#   bash benchmarks/h200.sh frontier  the build probe's FP8 answer (GPU test), and the demo model's frontier on the
#                                     default GPU grid (speed on 64 x 512)
#   bash benchmarks/h200.sh rescore   logged rollouts rescored on the 1.1B shape (exact KL), 1,000 and 6,000 sequences of
#                                     256 + 512 tokens: time and the CLI process's peak memory
#   bash benchmarks/h200.sh ray       issue 31: Ray's overhead, two half-card workers against one process (needs Ray there)
#   bash benchmarks/h200.sh rescorevs issue 31: a rescore's positions/s against a compare's on the same ids (1.1B shape)
#   bash benchmarks/h200.sh moe       issue 30: the Qwen3-30B-A3B shape (16 of 48 layers): speed, exact KL, routing, replay
#   bash benchmarks/h200.sh moetest   issue 30: the Qwen3-MoE GPU test (vLLM's two ways read the same experts)
#   bash benchmarks/h200.sh qwen3     issue 30: the Qwen3-8B shape: speed against the bare engines, exact KL
#   bash benchmarks/h200.sh gemma2    issue 30: the Gemma-2-9B shape (soft-caps: HF runs eager attention for it, which applies them)
#   bash benchmarks/h200.sh floor     the noise floor's cost (1.1B compare speed) and each of its calls timed (floor_profile.py)
#   bash benchmarks/h200.sh layers    issue 44: the 8B shape's layer profile in bfloat16 (GPU test) and the layer part's cost
#   bash benchmarks/h200.sh now       the exact KL's transport alone, the IPC test, the 1.1B compare speed, and
#                                     a profile of a compare with the exact KL (the HF host's phases included)
set -uo pipefail
OUT=${OUT:-benchmarks/results/h200-run}
mkdir -p "$OUT" /root/models
export PYTHONUNBUFFERED=1 LPP_GPU_RESULTS="$OUT/gpu.md" LOGPROB_PARITY_HOME=/root/lpp-home
TOK=/tmp/models/smollm2-135m
B8=/root/models/llama-3.1-8b-shape
build8b() {
  [ -f "$B8/config.json" ] || python -c "
from pathlib import Path; from benchmarks.compare_speed import build_llama8b
build_llama8b(Path('$B8'), '$TOK', 'cuda')" 2>&1 | tail -3
}
case "${1:-}" in
  tests)
    python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu.py -k "ipc or verdict_equals" 2>&1 | tail -15 | tee "$OUT/tests.log"
    python benchmarks/compare_speed.py --model tinyllama --tokenizer $TOK --out "$OUT/compare_speed_1b.md" 2>&1 | tail -16 ;;
  floor)
    python benchmarks/floor_profile.py --model tinyllama --tokenizer $TOK --out "$OUT/floor_profile_1b.md" 2>&1 | grep "^|\|^floor_profile"
    python benchmarks/compare_speed.py --model tinyllama --tokenizer $TOK --out "$OUT/compare_speed_1b.md" 2>&1 | grep "floor\|without the exact"
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "verdict_equals" 2>&1 | grep -E "^E |passed|failed" | tee "$OUT/tests.log" ;;
  rollout)
    python benchmarks/rollout.py --model $TOK --hf-batch-size 16 --out "$OUT/rollout.md" 2>&1 | tail -25 ;;
  again)
    python benchmarks/compare_speed.py --model tinyllama --tokenizer $TOK --repeats 2 --out "$OUT/compare_speed_1b.md" 2>&1 | tail -18
    LPP_HF_TIMING=1 python benchmarks/rollout_probe.py --model $TOK --out "$OUT/rollout_probe.txt" 2>&1 | tail -16 ;;
  8b)
    build8b
    LPP_GPU_8B=$B8 python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu.py -k "32k" 2>&1 | tail -8 | tee "$OUT/tests-8b.log"
    python benchmarks/compare_speed.py --model $B8 --out "$OUT/compare_speed_8b.md" 2>&1 | tail -14 ;;
  set)
    build8b
    python benchmarks/compare_speed.py --model $B8 --parts set --set 1000x2048 --hf-batch 8 --out "$OUT/set_8b.md" 2>&1 | tail -8 ;;
  frontier)
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "fp8_kernels or frontier" -s 2>&1 | tail -40 | tee "$OUT/frontier.log" ;;
  now)
    python benchmarks/kl_transport.py --out "$OUT/kl_transport.md" 2>&1 | tail -12
    python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu.py -k "ipc" 2>&1 | tail -5 | tee "$OUT/tests.log"
    python benchmarks/compare_speed.py --model tinyllama --tokenizer $TOK --out "$OUT/compare_speed_1b.md" 2>&1 | tail -18
    LPP_HF_TIMING=1 python benchmarks/compare_profile.py --model tinyllama --tokenizer $TOK --exact-kl --out "$OUT/compare_profile_kl.txt" \
      > "$OUT/compare_profile_kl.log" 2>&1
    head -1 "$OUT/compare_profile_kl.txt"; grep "lpp-timing" "$OUT/compare_profile_kl.log" | tail -3 ;;
  rescore)
    B1=/root/models/tinyllama-1.1b-random
    [ -f "$B1/config.json" ] || python -c "
from pathlib import Path; from benchmarks.engines import build_tinyllama
build_tinyllama(Path('$B1'), '$TOK', 'cuda')" 2>&1 | tail -3
    for n in 1000 6000; do
      python benchmarks/rescore_scale.py --model $B1 --sequences $n --prompt 256 --completion 512 --device cuda --dtype bfloat16 \
        --no-resume --no-json --out "$OUT/rescore_scale_1b_$n.md" 2>&1 | tail -8
    done ;;
  ray)
    # issue 31: Ray's overhead, two workers at half the card each against one process (1.1B shape, 2,000
    # prompts of about 512 tokens, exact KL). Needs Ray on the machine: ray==2.60.0 for cp312 and its
    # dependencies added to the bundle (not in ../shared/gpu/device-requirements.txt as of 2026-12-05).
    B1=/root/models/tinyllama-1.1b-random
    [ -f "$B1/config.json" ] || python -c "
from pathlib import Path; from benchmarks.engines import build_tinyllama
build_tinyllama(Path('$B1'), '$TOK', 'cuda')" 2>&1 | tail -3
    python benchmarks/ray_overhead.py --model $B1 --prompts 2000 --words 420 --workers 2 --gpus-per-worker 0.5 \
      --device cuda --dtype bfloat16 --out "$OUT/ray_overhead_1b.md" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -12 ;;
  rescorevs)
    # issue 31, item 4: a rescore's scored positions/s against a compare's on the same ids (target >= 0.9x)
    B1=/root/models/tinyllama-1.1b-random
    [ -f "$B1/config.json" ] || python -c "
from pathlib import Path; from benchmarks.engines import build_tinyllama
build_tinyllama(Path('$B1'), '$TOK', 'cuda')" 2>&1 | tail -3
    python benchmarks/rescore_vs_compare.py --model $B1 --sequences 6000 --prompt 256 --completion 512 --device cuda \
      --dtype bfloat16 --out "$OUT/rescore_vs_compare_1b.md" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -10 ;;
  moe)
    python benchmarks/compare_speed.py --model qwen3_30b_a3b --layers 16 --tokenizer $TOK --build-dir /root/models \
      --repeats 2 --out "$OUT/compare_speed_qwen3_30b_a3b.md" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -24
    rm -rf /root/models/qwen3_30b_a3b-shape-16l ;;
  moetest)
    python -m pytest -q -x -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "qwen3_moe" 2>&1 | grep -E "passed|failed|Error|assert|routing_flip" \
      | tail -12 | tee "$OUT/tests-moe.log" ;;
  qwen3|gemma2)
    shape=$([ "$1" = qwen3 ] && echo qwen3_8b || echo gemma2_9b)
    python benchmarks/compare_speed.py --model $shape --tokenizer $TOK --build-dir /root/models --repeats 1 \
      --out "$OUT/compare_speed_$1.md" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -20
    rm -rf /root/models/*-shape ;;
  layers)
    build8b
    LPP_GPU_8B=$B8 python -m pytest -q -x -s -p no:cacheprovider -m gpu tests/test_gpu.py -k "layer_profile" 2>&1 \
      | grep -E "passed|failed|Error|assert|^\| 8B" | tail -12 | tee "$OUT/tests-layers.log"
    python benchmarks/layers_cost.py --model $TOK --tokens 1024 --dtype bfloat16 --device cuda --out "$OUT/layers_cost_demo.md" 2>&1 | tail -14 ;;
  *) echo "usage: $0 tests|floor|rollout|again|8b|set|frontier|now|rescore|moe|moetest|qwen3|gemma2|ray|rescorevs|layers" >&2; exit 2 ;;
esac
