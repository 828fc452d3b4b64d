#!/usr/bin/env bash
# Run on the CPU side before a GPU run: puts what benchmarks/gpu_check.sh needs into the ignored
# folder .gpu/, which travels with the working tree (carry ".gpu"): the FlashInfer bundle, its
# smoke test, and a pure-Python pytest for a GPU machine that has none. About 40 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/gpu}
VENV_PY=${VENV_PY:-.venv/bin/python}

exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" || echo '/.gpu/' >> "$exclude"
mkdir -p .gpu
cp "$SHARED/fi_site_aot.tar.xz" "$SHARED/fi_smoke.py" .gpu/

# pytest and its pure-Python dependencies, without this Python's bytecode caches
rm -rf .gpu/pylib && mkdir -p .gpu/pylib
purelib=$("$VENV_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for name in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    cp -r "$purelib/$name" .gpu/pylib/
done
find .gpu/pylib -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh .gpu
