#!/usr/bin/env bash
# Every GPU claim of the project in one command, on a fresh GPU machine with no network. Run from anywhere:
#   bash perf/run_gpu.sh                              # all stages, in this order:
#   bash perf/run_gpu.sh tests train_step results     # or only the named ones (to fit a time limit)
# Stages: preset          python -m track_1_short.train experiment=record_1gpu -> perf/results/record_1gpu.json
#                         (PRESET_ARGS="model.loss_impl=reference" PRESET_NAME=record_1gpu_loss_reference:
#                         extra overrides, and the name of the run and its JSON, for a before/after pair)
#         tests           python3 -m pytest -m gpu -q                      (log: pytest_gpu.log)
#                         (GPU_TESTS="tests/perf/test_bank_graphs.py tests/optim": only those paths; the
#                         whole GPU suite takes over 10 minutes on one H100, so split it where calls are capped)
#         replicated_adam perf/bench_replicated_adam.py -> perf/results/replicated_adam.json
#         optimizer       perf/bench_optimizer.py --bank-update eager triton \
#                                                       --cascade-gram bmm squared gram_space \
#                                                       --bank-graphs off on --top-kernels 12
#                                                       -> perf/results/optimizer.json
#         cascade_products  perf/bench_cascade_products.py -> perf/results/cascade_products.json
#         train_step      perf/bench_train_step.py      -> perf/results/train_step.json
#                         (TRAIN_STEP_ARGS="optim.bank_update=triton" TRAIN_STEP_NAME=train_step_triton_bank:
#                         Hydra overrides, and the JSON's name, for a before/after pair)
#         loss            perf/bench_loss.py                -> perf/results/loss.json
#         mlp             perf/bench_mlp.py (the ReLU^2 MLP per model.mlp_impl, and its epilogue GEMMs alone
#                         against cuBLAS's)                  -> perf/results/mlp.json
#         final_val       perf/bench_final_val.py (the canonical mask's load and its validation pass)
#                                                       -> perf/results/final_val.json
#         attention       perf/bench_attention.py (FlexAttention against flash-attn-4 where its wheels are in
#                         .whl/: flash-attn-4, nvidia-cutlass-dsl with its libs-core, libs-base and libs-cu13,
#                         quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops; libs-cu13 alone is 92 MB)
#                                                       -> perf/results/attention.json
#         levers          perf/bench_train_step.py --stages 2, the default against each opt-in fast path as an
#                         --arm (LEVERS: "name=override ..." per line, default below) -> train_step_levers.json
#         scaling         perf/scaling.py (the preset through torchrun on 1 and all GPUs; skipped on one GPU)
#                                                       -> perf/results/scaling.json
#         ablation        perf/ablation.py (the preset, then each of the record's components off in turn;
#                         ABLATION_ARGS="--arms all ngram --seeds 0": a subset; 3 seeds of 6 arms by default,
#                         over an hour on one H100, three rounds of runs side by side on 8 GPUs; the attention
#                         arm needs the flash-attn-4 wheels in .whl/, as the attention stage does)
#                                                       -> perf/results/ablation.json
#         results         perf/results.py               -> perf/RESULTS.md (from every JSON in perf/results/)
# The image has torch, triton, numpy, scipy, matplotlib, tqdm and pytest, not hydra-core, omegaconf or
# antlr4: their wheels travel in .whl/ and are installed into .site/; nothing else is installed.
# GIT_COMMIT=<sha> names the commit in every JSON, where the machine's copy of .git may be stale.
# A failing stage is reported loudly and the later stages still run (GPU time is scarce); the script then
# exits 1 naming the failed stages. Killed inside a stage (a timeout), it names that stage as cut short and
# exits non-zero. With $OUT set, the logs grow there and each stage's JSON (and RESULTS.md) is copied there
# when the stage ends, so a run cut short still hands back what it did. Flat names, at most
# 10 files come back from a lent machine, so name fewer stages there: pytest_gpu.log, bench.log,
# <name>_log.txt, <name>_events.jsonl, <name>.json, replicated_adam.json, optimizer.json, train_step.json,
# loss.json, scaling.json, RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
all_stages=(preset tests replicated_adam optimizer cascade_products train_step loss mlp final_val attention levers
  scaling ablation results)
stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=("${all_stages[@]}")
for s in "${stages[@]}"; do
  if [[ " ${all_stages[*]} " != *" $s "* ]]; then
    echo "run_gpu.sh: unknown stage '$s'; stages: ${all_stages[*]}" >&2
    exit 2
  fi
done

if [[ -n ${OUT:-} ]]; then
  logs=$OUT
  mkdir -p "$logs"
else
  logs=$(mktemp -d "${TMPDIR:-/tmp}/run_gpu.XXXXXX")
fi
log=$logs/bench.log
failed=()

die() {  # message: say it on stderr and in the log, then stop
  echo "run_gpu.sh: $*" | tee -a "$log" >&2
  exit 1
}

hand_back() {  # file: copy it next to the logs (nothing to do without $OUT)
  if [[ -n ${OUT:-} ]]; then cp "$1" "$OUT/$(basename "$1")"; fi
}

current=""  # the stage running now, named if the script is killed inside it

summary() {
  local rc=$?
  if [[ -n $current ]]; then
    # Killed mid-stage (a timeout's TERM, a ^C): bash runs this trap with the status of the last command that
    # finished, often 0, so the stage itself says the run is not whole; its processes are stopped with it.
    echo "run_gpu.sh: FAILED: stage '$current' was cut short (killed or interrupted; logs in $logs)" \
      | tee -a "$log" >&2
    pkill -TERM -P $$ 2>/dev/null || true
    [[ $rc -ne 0 ]] || rc=143
  elif [[ ${#failed[@]} -gt 0 ]]; then
    echo "run_gpu.sh: FAILED stage(s): ${failed[*]} (logs in $logs)" >&2
    rc=1
  elif [[ $rc -ne 0 ]]; then
    echo "run_gpu.sh: FAILED before the stages finished (exit $rc; logs in $logs)" >&2
  else
    echo "run_gpu.sh: all stages passed: ${stages[*]}"
  fi
  exit "$rc"
}
trap summary EXIT

# Hydra and OmegaConf: use what is importable, else install the carried wheels (no index, no dependencies).
if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
  compgen -G ".whl/*.whl" >/dev/null || die "hydra-core/omegaconf are not importable and .whl/ holds no" \
    "wheels; put those of hydra-core 1.3.8, omegaconf 2.3.1 and antlr4-python3-runtime 4.9.3 in .whl/."
  python3 -m pip install -q --no-index --no-deps --upgrade --target .site .whl/*.whl 2>&1 | tee -a "$log"
fi
export PYTHONPATH="$root/.site:$root:${PYTHONPATH:-}"
# pip --target runs no .pth start-up hook, and nvidia-cutlass-dsl (flash-attn-4's CuTeDSL, for the attention
# stage) puts its packages on sys.path through one.
if [[ -d .site/nvidia_cutlass_dsl/dsl_packages ]]; then
  PYTHONPATH="$PYTHONPATH:$root/.site/nvidia_cutlass_dsl/dsl_packages"
fi
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1

{
  echo "run_gpu.sh: stages ${stages[*]}; $(date -u +%FT%TZ)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda',
    torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  nvidia-smi 2>/dev/null || echo "(no nvidia-smi)"
} 2>&1 | tee -a "$log"
# Only the results stage may run without a GPU: the others would measure or skip everything and look green.
if [[ ${stages[*]} != results ]] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"
then
  die "no CUDA device visible to torch; stages other than 'results' need one."
fi

run_stage() {  # name command...: run it, report its time, remember a failure and go on
  local name=$1 start=$SECONDS rc=0
  shift
  echo "=== $name: $*" | tee -a "$log"
  current=$name
  "$@" || rc=$?
  current=""
  if [[ $rc -eq 0 ]]; then
    echo "=== $name: ok in $((SECONDS - start)) s" | tee -a "$log"
  else
    echo "=== $name: FAILED with exit $rc after $((SECONDS - start)) s" | tee -a "$log" >&2
    failed+=("$name")
  fi
}

gpu_tests() {
  # GPU_TESTS is a list of test paths: split on spaces on purpose.
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-} 2>&1 | tee "$logs/pytest_gpu.log"
}

bench() {  # name: perf/bench_<name>.py --out perf/results/<name>.json
  local script="perf/bench_$1.py" json="perf/results/$1.json"
  [[ $1 != train_step || -z ${TRAIN_STEP_NAME:-} ]] || json="perf/results/$TRAIN_STEP_NAME.json"
  [[ -f $script ]] || { echo "$script does not exist" >&2; return 1; }
  # bench_train_step.py times Trainer.train_step under experiment=record_1gpu (input checks off, as in a record).
  local args=()
  # Every bank-update route against every Gram route: the arms the optimizer's defaults are chosen from.
  [[ $1 != optimizer ]] || args=(--bank-update eager triton --cascade-gram bmm squared gram_space
    --bank-graphs off on --top-kernels 12)
  # TRAIN_STEP_ARGS is a list of Hydra overrides: split on spaces on purpose.
  # shellcheck disable=SC2206
  [[ $1 != train_step || -z ${TRAIN_STEP_ARGS:-} ]] || args=(${TRAIN_STEP_ARGS})
  python3 "$script" "${args[@]}" --out "$json" 2>&1 | tee -a "$log" || return
  hand_back "$json"
}

preset() {  # the one-GPU record preset through the trainer, then its figures (perf/run_summary.py)
  # The run directory stays out of $OUT (a run writes more files than come back); its log and events do.
  local name=${PRESET_NAME:-record_1gpu} runs date
  local cmd=(python3 -m track_1_short.train experiment=record_1gpu)
  # PRESET_ARGS is a list of Hydra overrides: split on spaces on purpose.
  # shellcheck disable=SC2206
  [[ -z ${PRESET_ARGS:-} ]] || cmd+=(${PRESET_ARGS})
  runs=$(mktemp -d "${TMPDIR:-/tmp}/record_1gpu.XXXXXX")
  date=$(date -u +%FT%T+00:00)
  "${cmd[@]}" runs_root="$runs" run_name="$name" 2>&1 | tee -a "$log" || return
  if [[ -n ${OUT:-} ]]; then
    cp "$runs/$name/log.txt" "$OUT/${name}_log.txt"
    cp "$runs/$name/events.jsonl" "$OUT/${name}_events.jsonl"
  fi
  python3 perf/run_summary.py "$runs/$name" --out "perf/results/$name.json" --date "$date" \
    --command "${cmd[*]}" --commit "${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" 2>&1 \
    | tee -a "$log" \
    || return
  hand_back "perf/results/$name.json"
}

# The opt-in fast paths, one arm each, measured against the defaults at stage 2 (about 50 s an arm, most of it
# the arm's first compiled step), and the references of the bank update and of the replicated Adam step; FP8
# (off in the presets) with its one-pass quantise, with the torch-op reference of it, and with the MLP's
# quantises in its GEMMs' epilogues; the n-gram table's sorted fold, its one-kernel embedding, and the table
# off (what the table costs, kernel by kernel and idle stretch by idle stretch); the bf16 ReLU^2 MLP with its
# activation in the GEMM epilogues; the NaN guard off (what its one host read a step costs in idle device
# time).
default_levers='bank_graphs=optim.bank_graphs=true
bank_eager=optim.bank_update=eager
replicated_reference=optim.replicated_impl=reference
fp8=model.fp8.mlp=true model.fp8.qkv=true model.fp8.lm_head=true
fp8_quantize_reference=model.fp8.mlp=true model.fp8.qkv=true model.fp8.lm_head=true model.fp8.quantize_impl=reference
fp8_fused_mlp=model.fp8.mlp=true model.fp8.qkv=true model.fp8.lm_head=true model.fp8.mlp_impl=triton
ngram_fold=model.ngram.fold_impl=triton
ngram_embed=model.ngram.embed_impl=triton
ngram_off=model.ngram.enabled=false
mlp=model.mlp_impl=triton
nan_off=guards.nan_policy=off'

levers() {
  local arms=() line
  while IFS= read -r line; do
    [[ -z $line ]] || arms+=(--arm "$line")
  done <<<"${LEVERS:-$default_levers}"
  python3 perf/bench_train_step.py --stages 2 "${arms[@]}" --out perf/results/train_step_levers.json 2>&1 \
    | tee -a "$log" || return
  hand_back perf/results/train_step_levers.json
}

scaling() {  # only with several GPUs: on one, its K = 1 run is the preset stage's
  local n
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [[ $n -lt 2 ]]; then
    echo "scaling: $n GPU visible; it needs 2 or more (nothing to compare the one-GPU run with)" | tee -a "$log"
    return 0
  fi
  python3 perf/scaling.py --out perf/results/scaling.json 2>&1 | tee -a "$log" || return
  hand_back perf/results/scaling.json
}

ablation() {
  # ABLATION_ARGS is a list of arguments: split on spaces on purpose.
  # shellcheck disable=SC2086
  python3 perf/ablation.py ${ABLATION_ARGS:-} --out perf/results/ablation.json 2>&1 | tee -a "$log" || return
  hand_back perf/results/ablation.json
}

results_md() {
  python3 perf/results.py 2>&1 | tee -a "$log" || return
  hand_back perf/RESULTS.md
}

for s in "${stages[@]}"; do
  case $s in
    preset) run_stage preset preset ;;
    tests) run_stage tests gpu_tests ;;
    levers) run_stage levers levers ;;
    scaling) run_stage scaling scaling ;;
    ablation) run_stage ablation ablation ;;
    results) run_stage results results_md ;;
    *) run_stage "$s" bench "$s" ;;
  esac
done
