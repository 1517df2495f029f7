#!/usr/bin/env bash
# Spark GPU discovery script: prints this machine's NVIDIA GPUs in the JSON form Spark
# expects from spark.worker.resource.gpu.discoveryScript (or the executor's), e.g.
#   {"name": "gpu", "addresses": ["0", "1"]}
# The addresses are nvidia-smi's indices; spark-estimator pins each training task to the
# address Spark assigned it (mapped through CUDA_VISIBLE_DEVICES when that is set).
set -euo pipefail
indices=$(nvidia-smi --query-gpu=index --format=csv,noheader)
addresses=""
for index in $indices; do
  addresses+="${addresses:+, }\"${index}\""
done
echo "{\"name\": \"gpu\", \"addresses\": [${addresses}]}"
