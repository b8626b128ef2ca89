#!/usr/bin/env bash
# Generates the Python modules of the kubelet's pod-resources API (`make protos`):
#   stallwatch/exporters/kubelet/api.proto -> api_pb2.py (messages) and api_pb2.pyi (their types)
# with the pinned grpcio-tools of the `test` extra, so that the output is the same everywhere.
#   scripts/generate-protos.sh [OUTDIR]     OUTDIR defaults to stallwatch/exporters (a test writes elsewhere
#                                           and compares, so stale modules fail the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-stallwatch/exporters}
mkdir -p "$out/kubelet"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I stallwatch/exporters --python_out="$out" --pyi_out="$out" \
  kubelet/api.proto
