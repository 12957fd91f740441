#!/usr/bin/env bash
# Everything worth running in one GPU session, as one prepared script of at most 7 minutes
# (a 15-minute lease leaves room for the machine's start and one more command): the GPU tests, then every benchmark at
# the papers' size (12 x 768, n = 1024, bf16), each time-boxed, then ONE table of the issue-14
# targets (benchmarks/gpu_targets.py). A part that fails or runs out of time leaves its rows
# "not measured"; the table says which. Logs and JSON go to $OUT (default
# benchmarks/results/<device>). Needs no install: PYTHONPATH=src and a python with torch.
#
#   bash benchmarks/gpu_check.sh                          # on a GPU machine
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh     # the dry path: tiny sizes on the CPU
#   GPU_CHECK_BUDGET=300 PY=python3 bash benchmarks/gpu_check.sh
#
# Order (the most wanted first, so a short budget cuts the least): tests; training, eager;
# decoding; training, compiled beside eager (`train.compile=auto` compiles on CUDA); our
# aogpt beside the AO-GPT authors' trainer (when .ref/ holds their repository); the Figure-4
# benchmark; aogpt speculative K = 4 through compiled rounds beside sequential decoding
# (batch 1); on CUDA, the kernels of a compiled pass.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-benchmarks/results/$DEVICE}
BUDGET=${GPU_CHECK_BUDGET:-405} # seconds for all parts; the table takes a second more
# each part's own limit is scaled: the CPU dry path on a shared 2-core machine is slower
SCALE=${GPU_CHECK_SCALE:-$([ "$DEVICE" = cpu ] && echo 4 || echo 1)}
mkdir -p "$OUT"
rm -f "$OUT"/{gpu_tests.txt,compiled_kernels.json,decode_compiled.json,train_step.json,train_compile.json,decode.json,decoder_vs_encoder.json,vs_reference.json,head_loss.json}
START=$SECONDS

# run NAME SECONDS CMD...: CMD time-boxed to SECONDS or what is left of the budget; its
# output in $OUT/NAME.log, the last lines shown
run() {
  local name=$1 limit=$2 left rc t0
  shift 2
  limit=$((limit * SCALE))
  left=$((BUDGET - (SECONDS - START)))
  if ((limit > left)); then limit=$left; fi
  if ((limit < 15)); then
    echo "[$name] skipped: the ${BUDGET}s budget is spent"
    return
  fi
  echo "[$name] at most ${limit}s: $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n "${GPU_CHECK_TAIL:-14}" "$OUT/$name.log" | sed "s/^/  /"
  if ((rc == 124 || rc == 137)); then
    echo "[$name] TIMED OUT after ${limit}s"
  else
    echo "[$name] exit $rc in $((SECONDS - t0))s"
  fi
}

# budget flags: --budget where the script takes it, else one round
budget() { # SCRIPT SECONDS
  if ((BUDGET - (SECONDS - START) < 15)); then return; fi # the part is skipped anyway
  if "$PY" "benchmarks/$1.py" --help 2>/dev/null | grep -q -- "--budget"; then
    echo "--budget $2"
  else
    echo "--repeats 1"
  fi
}

"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
if [ "$DEVICE" = cpu ]; then # the dry path: the same parts at tiny sizes
  TRAIN=(--layers 2 --d-model 64 --heads 2 --seq-len 32 --vocab 50 --batch 2 --repeats 1)
  COMPILE=(--compile both --compile-backend aot_eager)
  DECODE=(--sizes tiny --seq-len 32 --batches 1,8 --dtype fp32)
  DVE=(--lengths 32 --steps 8 --batch 8 --dtype fp32)
  TESTS=(tests/test_gpu.py)
  VSREF=(--compile compiled --repeats 1)
  HEAD=(--repeats 2)
  DECODE_COMPILED=(--sizes tiny --seq-len 32 --dtype fp32 --compile-passes aot_eager)
else
  TRAIN=(--paper --dtype bf16 --repeats 3)
  COMPILE=(--compile both)
  DECODE=(--paper --dtype bf16 --batches 1,8 --graphs) # CUDA graphs (eager where they fail)
  DVE=(--size small --dtype bf16 --lengths 1024 --steps 256 --batch 8 --graphs)
  TESTS=(tests/)
  VSREF=(--paper --compile both --repeats 3)
  HEAD=(--paper --dtype bf16 --repeats 5)
  DECODE_COMPILED=(--sizes small --seq-len 1024 --dtype bf16 --graphs --compile-passes inductor)
fi

ANYORDER_GPU_TEST_DEVICE=$DEVICE run gpu_tests 100 \
  "$PY" -m pytest -q -m gpu "${TESTS[@]}" -o addopts="" -p no:cacheprovider
cp "$OUT/gpu_tests.log" "$OUT/gpu_tests.txt" 2>/dev/null
run train_step 75 "$PY" benchmarks/train_step.py --device "$DEVICE" "${TRAIN[@]}" \
  --json "$OUT/train_step.json"
# shellcheck disable=SC2046  # budget's words are flags
run decode 100 "$PY" benchmarks/decode.py --device "$DEVICE" "${DECODE[@]}" --lemma1 --speculative 4 \
  $(budget decode 60) --json "$OUT/decode.json"
run train_compile 150 "$PY" benchmarks/train_step.py --device "$DEVICE" "${TRAIN[@]}" \
  "${COMPILE[@]}" --models gpt,aogpt,armd_half --no-peak --json "$OUT/train_compile.json"
run head_loss 30 "$PY" benchmarks/head_loss.py --device "$DEVICE" "${HEAD[@]}" \
  --json "$OUT/head_loss.json"
if [ -f .ref/model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm.py ]; then
  run vs_reference 120 "$PY" benchmarks/vs_reference_trainer.py --device "$DEVICE" "${VSREF[@]}" \
    --json "$OUT/vs_reference.json"
else
  echo "[vs_reference] skipped: no .ref/ (unpack scxue/AO-GPT-MDM there; carry it to the GPU)"
fi
# shellcheck disable=SC2046
run decoder_vs_encoder 60 "$PY" benchmarks/decoder_vs_encoder.py --device "$DEVICE" "${DVE[@]}" \
  $(budget decoder_vs_encoder 30) --json "$OUT/decoder_vs_encoder.json" \
  --plot "$OUT/decoder_vs_encoder.png"

# issue 41: does a compiled speculative round pay? (its 7 key levels compile in the warm-up)
run decode_compiled 150 "$PY" benchmarks/decode.py --device "$DEVICE" "${DECODE_COMPILED[@]}" \
  --batches 1 --speculative 4 --rows "aogpt seq,aogpt spec K=4,aogpt spec K=4 compiled" --repeats 1 \
  --json "$OUT/decode_compiled.json"
if [ "$DEVICE" != cpu ]; then # kernels a compiled pass: Triton's count (the CPU's: inductor's C++)
  run compiled_kernels 90 "$PY" benchmarks/compiled_kernels.py --device "$DEVICE" --dtype bf16 \
    --samplers gpt-seq,aogpt-spec-K4,armd-confidence-P4 --json "$OUT/compiled_kernels.json"
fi

echo "(all parts: $((SECONDS - START))s of the ${BUDGET}s budget)"
"$PY" benchmarks/gpu_targets.py --dir "$OUT" --json "$OUT/targets.json"
