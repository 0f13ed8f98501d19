#!/bin/bash
# The shape of Qwen's finetune/finetune_lora_ds.sh (the multi-node guide's script): it reads NNODES,
# NODE_RANK, MASTER_ADDR and MASTER_PORT from the environment, falls back to one local node, and
# starts torchrun itself. `trainer launch -- bash finetune/finetune_lora_ds.sh -m ... -d ...` must
# run it unchanged. One line differs from Qwen's: GPUS_PER_NODE keeps the launcher's value when
# it is set (Qwen's asks torch for the CUDA device count, which is 0 on the CPU test machines).
export CUDA_DEVICE_MAX_CONNECTIONS=1
DIR=$(pwd)

GPUS_PER_NODE=${GPUS_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count())')}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6001}

MODEL="Qwen/Qwen-7B-Chat"
DATA="path_to_data.json"
DS_CONFIG_PATH="finetune/ds_config_zero2.json"

function usage() {
    echo 'Usage: bash finetune/finetune_lora_ds.sh [-m MODEL_PATH] [-d DATA_PATH] [--deepspeed DS_CONFIG_PATH]'
}

while [[ "$1" != "" ]]; do
    case $1 in
        -m | --model )
            shift
            MODEL=$1
            ;;
        -d | --data )
            shift
            DATA=$1
            ;;
        --deepspeed )
            shift
            DS_CONFIG_PATH=$1
            ;;
        -h | --help )
            usage
            exit 0
            ;;
        * )
            echo "Unknown argument ${1}"
            exit 1
            ;;
    esac
    shift
done

DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

torchrun $DISTRIBUTED_ARGS finetune.py \
    --model_name_or_path $MODEL \
    --data_path $DATA \
    --bf16 False \
    --output_dir output_qwen \
    --max_steps 6 \
    --per_device_train_batch_size 2 \
    --learning_rate 3e-2 \
    --save_steps 3 \
    --deepspeed ${DS_CONFIG_PATH}
