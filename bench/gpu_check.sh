#!/usr/bin/env bash
# One-shot GPU check of `trainer train` on a borrowed single-GPU machine (no network): environment,
# the health monitor's NVML readings, then short bf16 runs of a random-init Qwen2 of about 0.4B
# parameters through torchrun (1 process, nccl): full fine-tune ddp, LoRA ddp, Q-LoRA ddp, DeepSpeed
# ZeRO-2 and ZeRO-3 (full), accelerate (full). Tokens/s, step time, peak GPU memory and MFU of each
# in one table and in $OUT/gpu_check.json; every log in $OUT/gpu_check_logs.tar.gz.
#
#   bash bench/gpu_check.sh                  # on the GPU machine, from the repo root, .whl/ carried
#   GPU_CHECK_CPU=1 bash bench/gpu_check.sh  # the same steps, tiny, on the CPU (gloo, no Q-LoRA)
#
# bench/gpu_prepare.sh fills .whl/ (deepspeed, pydantic, hjson, datasets, bitsandbytes...) and prints
# the `run` call. Each step runs under `timeout`; a failed step is recorded and the next one runs; runs
# that would start after GPU_CHECK_DEADLINE seconds (default 330) are skipped, so the whole script
# ends within about 6 minutes. GPU_CHECK_RUNS="zero3_full accelerate_full" runs only those (a rerun).
#
# GPU_CHECK_SPEEDUPS=1: instead of the runs above, issue 41's before/after: each group's runs in one
# torchrun process (`gpu_check.py variants`, no checkpoint written), `*_before` with every speed-up off
# (TRAINER_SPEEDUPS_OFF=all: the trainer as it was), `*_after` with all on, then each speed-up off
# alone and train.compile on; the table in $OUT/speedups.json and at the end of the output. The runs
# set train.compile=false where they do not name it (it was the default then).
# GPU_CHECK_SPEEDUPS=final: the defaults as they ended (compile auto) against before, compile under
# Q-LoRA and ZeRO-2, and a second process's compile from the warm cache.
# GPU_CHECK_SPEEDUPS=round3: the third round's speed-ups each off alone against the defaults, a micro
# batch twice as large, and a kernel profile (bench/step_profile.py) of full, LoRA, Q-LoRA and ZeRO-2.
set -u
cd "$(dirname "$0")/.."
START=$SECONDS
CPU=${GPU_CHECK_CPU:-0}
DEADLINE=${GPU_CHECK_DEADLINE:-330}
RUN_LIMIT=${GPU_CHECK_RUN_LIMIT:-120}
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

# The wheels are built for the GPU machine's Python 3.12; the CPU mode uses this machine's packages.
if [ "$CPU" != 1 ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  t0=$SECONDS
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "gpu_check: installing the carried wheels FAILED (continuing)"
  echo "gpu_check: wheels installed in $((SECONDS - t0)) s"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# Work in RAM where there is room: every run writes a final checkpoint (GBs at full size).
WORK=${GPU_CHECK_WORK:-}
if [ -z "$WORK" ]; then
  WORK=/tmp/gpu_check
  if [ "$CPU" != 1 ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR==2 {print $4}')" -gt 30000000 ]; then
    WORK=/dev/shm/gpu_check
  fi
fi
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/runs"
: >"$WORK/steps.tsv"
echo "gpu_check: work dir $WORK, mode $([ "$CPU" = 1 ] && echo cpu || echo gpu)"

if [ "$CPU" = 1 ]; then
  MODEL_ARGS=(--hidden 64 --layers 2 --vocab 1024)
  RECORDS=40 CHARS=1200 MAXLEN=128 MB=4 STEPS=6 LOG_EVERY=2 PRECISION=auto VSTEPS=14 VLOG_EVERY=2
else
  # Qwen2 layout, about 0.4B parameters: 24 layers of hidden 1024 (16 heads, 4 KV heads, MLP 4096),
  # a 32000-row tied embedding over an 8192-token BPE tokenizer.
  MODEL_ARGS=(--hidden 1024 --layers 24 --heads 16 --kv-heads 4 --intermediate 4096 --vocab 8192 --model-vocab 32000)
  RECORDS=520 CHARS=5600 MAXLEN=1024 MB=16 STEPS=30 LOG_EVERY=10 PRECISION=bf16 VSTEPS=25 VLOG_EVERY=5
fi
MODEL=$WORK/model
DATA=$WORK/data.jsonl

# step NAME LIMIT_S COMMAND...: run under timeout, log to $WORK/logs/NAME.log, record status.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc status
  shift 2
  echo "--- $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status="rc=$rc" ;; esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
  tail -n 25 "$WORK/logs/$name.log"
  echo "--- $name: $status in $((SECONDS - t0)) s"
  return $rc
}

skip() {
  printf '%s\t%s\t0\t%s\n' "$1" skipped "$2" >>"$WORK/steps.tsv"
  echo "--- $1: skipped ($2)"
}

# variants TAG PLAN_JSON: one torchrun process, `trainer train` once per variant of the plan.
variants() {
  local tag=$1 plan=$2 left limit t0=$SECONDS rc status
  left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 40 ]; then
    skip "variants_$tag" "deadline: ${left}s left of GPU_CHECK_DEADLINE=${DEADLINE}"
    return
  fi
  limit=$left
  mkdir -p "$WORK/variants"
  local sets=(
    "model.name_or_path=$MODEL" "data.path=$DATA" data.format=text "model.max_length=$MAXLEN"
    "train.max_steps=$VSTEPS" "train.log_every=$VLOG_EVERY" "train.micro_batch_size=$MB"
    train.gradient_accumulation_steps=1 train.learning_rate=0.0001 train.min_lr=0.00001 train.warmup_steps=5
    "train.mixed_precision=$PRECISION" checkpoint.save_steps=0 checkpoint.resume=never health.poll_interval_s=1
  )
  [ "$SPEEDUPS" = 1 ] && sets+=(train.compile=false) # the default of the first measurement
  local args=()
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  echo "--- variants $tag (limit ${limit}s)"
  timeout -k 10 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/gpu_check.py variants --no-save --plan "$plan" --budget-s $((limit - 30)) \
    "$WORK/variants/$tag.json" -- "${args[@]}" >"$WORK/logs/variants_$tag.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status="rc=$rc" ;; esac
  printf '%s\t%s\t%s\n' "variants_$tag" "$status" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
  grep -E "^variant |Error|error:|trainer:" "$WORK/logs/variants_$tag.log" | cut -c1-400 | tail -n 24
  echo "--- variants $tag: $status in $((SECONDS - t0)) s"
}

# train NAME SET...: `trainer train` (bench/gpu_check.py worker) under torchrun, 1 process.
train() {
  local name=$1 dir=$WORK/runs/$1 left limit smi_pid=""
  shift
  if [ -n "${GPU_CHECK_RUNS:-}" ] && [[ " $GPU_CHECK_RUNS " != *" $name "* ]]; then
    skip "$name" "not in GPU_CHECK_RUNS"
    return
  fi
  mkdir -p "$dir"
  left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 45 ]; then
    skip "$name" "deadline: ${left}s left of GPU_CHECK_DEADLINE=${DEADLINE}"
    return
  fi
  limit=$((left < RUN_LIMIT ? left : RUN_LIMIT))
  local sets=(
    "model.name_or_path=$MODEL" "data.path=$DATA" data.format=text "model.max_length=$MAXLEN"
    "train.max_steps=$STEPS" "train.log_every=$LOG_EVERY" "train.micro_batch_size=$MB"
    train.gradient_accumulation_steps=1 train.learning_rate=0.0001 train.min_lr=0.00001 train.warmup_steps=5
    "train.mixed_precision=$PRECISION" checkpoint.save_steps=0 checkpoint.resume=never
    health.poll_interval_s=1 "output_dir=$dir/out" "$@"
  )
  printf '%s\n' "${sets[@]}" >"$dir/sets.txt"
  local args=()
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  if [ "$CPU" != 1 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used,utilization.gpu,power.draw,temperature.gpu \
      --format=csv,noheader,nounits -lms 250 >"$dir/smi.csv" 2>/dev/null &
    smi_pid=$!
  fi
  echo "--- $name (limit ${limit}s): ${*}"
  local t0=$SECONDS rc status
  timeout -k 10 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    bench/gpu_check.py worker "$dir/worker.json" -- train "${args[@]}" >"$dir/train.log" 2>&1
  rc=$?
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status="rc=$rc" ;; esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$WORK/steps.tsv"
  grep -E "^step |health monitor|^training |error|Error|trainer:" "$dir/train.log" | tail -n 12
  echo "--- $name: $status in $((SECONDS - t0)) s"
  # The checkpoint and the final model are GBs: gone before the next run (metrics, run.json stay).
  rm -rf "$dir/out/checkpoints" "$dir/out/final"
}

{
  echo "== nvidia-smi -L"
  timeout 30 nvidia-smi -L 2>&1 || echo "nvidia-smi: unavailable"
} | tee "$WORK/logs/nvidia_smi.log"
step env 90 "$PY" bench/gpu_check.py env "$WORK/env.json"
step health 60 "$PY" bench/gpu_check.py health "$WORK/health.json"
step build_model 150 "$PY" scripts/build_tiny_hf_model.py model "$MODEL" "${MODEL_ARGS[@]}"
step build_data 60 "$PY" bench/gpu_check.py data "$DATA" --records "$RECORDS" --chars "$CHARS"

# A JIT op build (DeepSpeed's shm_comm on the CPU) killed by a timeout leaves a lock every later
# load waits on forever: the project's own tool removes the locks nobody holds.
timeout 30 "$PY" -m trainer.torch_extensions remove-stale >"$WORK/logs/remove_stale.log" 2>&1

LORA=(lora.enabled=true lora.r=16 lora.alpha=32)
SPEEDUPS=${GPU_CHECK_SPEEDUPS:-0}
if [ "$SPEEDUPS" != 0 ] && [ -f "$MODEL/config.json" ] && [ -f "$DATA" ]; then
  v() { # v NAME OFF SET...: one variant as JSON
    local name=$1 off=$2
    shift 2
    "$PY" -c 'import json, sys; print(json.dumps({"name": sys.argv[1], "off": sys.argv[2], "sets": sys.argv[3:]}))' "$name" "$off" "$@"
  }
  plan() { local IFS=,; echo "[$*]"; }
  QLORA=()
  [ "$CPU" = 1 ] || QLORA=("$(v qlora_before all "${LORA[@]}" lora.qlora=true)" "$(v qlora_after "" "${LORA[@]}" lora.qlora=true)")
  NOCOMPILE=train.compile=false ZERO2=(distributed.engine=deepspeed distributed.zero_stage=2)
  vp() { # vp NAME OFF SET...: a variant whose steps VSTEPS-8..VSTEPS-6 are profiled (bench/step_profile.py)
    local name=$1 off=$2
    shift 2
    "$PY" -c 'import json, sys; print(json.dumps({"name": sys.argv[1], "off": sys.argv[2], "sets": sys.argv[4:], "profile": [int(sys.argv[3]) - 8, int(sys.argv[3]) - 6]}))' "$name" "$off" "$VSTEPS" "$@"
  }
  if [ "$SPEEDUPS" = round3 ]; then
    # Issue 41, third round: bf16 weights with fp32 masters (bf16_master), the compiled head and loss
    # (compiled_head), Q-LoRA's unquantized weights left in bf16 (qlora_bf16_rest), each against the
    # defaults with it off, a micro batch of 32; then a profile of where each kind of run's step goes
    # (its own variant, after the timed ones: the profiled steps are left out of its tokens/s).
    [ "$CPU" = 1 ] || QLORA=("$(v qlora_before all "${LORA[@]}" lora.qlora=true $NOCOMPILE)" \
      "$(v qlora_after "" "${LORA[@]}" lora.qlora=true)" \
      "$(v qlora__qlora_bf16_rest_off qlora_bf16_rest "${LORA[@]}" lora.qlora=true)" \
      "$(vp qlora_profile "" "${LORA[@]}" lora.qlora=true)")
    variants ddp "$(plan "$(v full_before all $NOCOMPILE)" "$(v full_after "")" \
      "$(v full__bf16_master_off bf16_master)" "$(v full__compiled_head_off compiled_head)" \
      "$(v lora_before all "${LORA[@]}" $NOCOMPILE)" "$(v lora_after "" "${LORA[@]}")" \
      "$(v lora_dropout0 "" "${LORA[@]}" lora.dropout=0)" "$(v full_mb32 "" train.micro_batch_size=$((MB * 2)))" \
      "$(vp full_profile "")" "$(vp lora_profile "" "${LORA[@]}")")"
    [ "$CPU" = 1 ] || variants qlora "$(plan "${QLORA[@]}")"
    # DeepSpeed once per process (a second deepspeed.initialize in a process fails: "Group ... is not
    # registered"): a group per run.
    variants zero2 "$(plan "$(v zero2_after "" "${ZERO2[@]}")")"
    variants zero2_before "$(plan "$(v zero2_before all "${ZERO2[@]}" $NOCOMPILE)")"
    variants zero2_profile "$(plan "$(vp zero2_profile "" "${ZERO2[@]}")")"
    # Not compiled by auto (never measured): accelerate compiled against its before.
    variants accelerate "$(plan "$(v accelerate_compile "" distributed.engine=accelerate train.compile=true)" \
      "$(v accelerate_before all distributed.engine=accelerate $NOCOMPILE)")"
    timeout 60 "$PY" bench/gpu_check.py variants-summary "$WORK" "$OUT" --seq-len "$MAXLEN" | tee "$OUT/speedups_summary.txt"
    SPEEDUPS=done
  fi
  if [ "$SPEEDUPS" = final ]; then
    # The defaults as they ended (train.compile=auto compiles ddp runs on a GPU) against the trainer
    # before (every speed-up off, no compile); compile where auto does not turn it on; a second
    # process's compile from the warm cache.
    [ "$CPU" = 1 ] || QLORA=("$(v qlora_before all "${LORA[@]}" lora.qlora=true $NOCOMPILE)" \
      "$(v qlora_compile "" "${LORA[@]}" lora.qlora=true train.compile=true)")
    variants ddp "$(plan "$(v full_before all $NOCOMPILE)" "$(v full_after "")" \
      "$(v lora_before all "${LORA[@]}" $NOCOMPILE)" "$(v lora_after "" "${LORA[@]}")" \
      "$(v lora_dropout0 "" "${LORA[@]}" lora.dropout=0)")"
    variants zero2_compile "$(plan "$(v zero2_compile "" "${ZERO2[@]}" train.compile=true)")"
    variants warm "$(plan "$(v full_after_warm_cache "")")"
    [ "$CPU" = 1 ] || variants qlora "$(plan "${QLORA[@]}")"
    variants zero2_before "$(plan "$(v zero2_before all "${ZERO2[@]}" $NOCOMPILE)")"
    timeout 60 "$PY" bench/gpu_check.py variants-summary "$WORK" "$OUT" | tee "$OUT/speedups_summary.txt"
    SPEEDUPS=done
  fi
  [ "$SPEEDUPS" = done ] || variants ddp "$(plan "$(v full_before all)" "$(v full_after "")" "$(v lora_before all "${LORA[@]}")" \
    "$(v lora_after "" "${LORA[@]}")" "${QLORA[@]}")"
  [ "$SPEEDUPS" = done ] || variants zero2_before "$(plan "$(v zero2_before all "${ZERO2[@]}")")"
  [ "$SPEEDUPS" = done ] || variants zero2_after "$(plan "$(v zero2_after "" "${ZERO2[@]}")")"
  [ "$SPEEDUPS" = done ] || variants each "$(plan "$(v full_compile "" train.compile=true)" "$(v full__chunked_loss_off chunked_loss)" \
    "$(v full__async_loss_off async_loss)" "$(v full__fused_adamw_off fused_adamw)" \
    "$(v lora_dropout0 "" "${LORA[@]}" lora.dropout=0)" "$(v lora_compile "" "${LORA[@]}" train.compile=true)")"
  [ "$SPEEDUPS" = done ] || timeout 60 "$PY" bench/gpu_check.py variants-summary "$WORK" "$OUT" |
    tee "$OUT/speedups_summary.txt"
elif [ -f "$MODEL/config.json" ] && [ -f "$DATA" ]; then
  train ddp_full distributed.engine=ddp
  train ddp_lora distributed.engine=ddp lora.enabled=true lora.r=16 lora.alpha=32
  # Where LoRA's time goes: the same run without the adapters' input dropout (named runs only).
  if [[ " ${GPU_CHECK_RUNS:-} " == *" ddp_lora_nodropout "* ]]; then
    train ddp_lora_nodropout distributed.engine=ddp lora.enabled=true lora.r=16 lora.alpha=32 lora.dropout=0
  fi
  if [ "$CPU" = 1 ]; then
    skip qlora_ddp "CPU mode: 4-bit bitsandbytes runs on CUDA GPUs only"
  else
    train qlora_ddp distributed.engine=ddp lora.enabled=true lora.r=16 lora.alpha=32 lora.qlora=true
  fi
  train zero2_full distributed.engine=deepspeed distributed.zero_stage=2
  train zero3_full distributed.engine=deepspeed distributed.zero_stage=3
  train accelerate_full distributed.engine=accelerate
else
  skip runs "no model or data (see build_model / build_data)"
fi

timeout 60 "$PY" bench/gpu_check.py summary "$WORK" "$OUT" | tee "$OUT/gpu_check_summary.txt"
tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" --exclude='*/out/checkpoints' --exclude='*/out/final' \
  logs runs steps.tsv $(cd "$WORK" && ls -d variants env.json health.json 2>/dev/null) 2>/dev/null
echo "gpu_check: done in $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
