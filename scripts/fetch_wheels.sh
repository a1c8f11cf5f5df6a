#!/usr/bin/env bash
# Fetch, on a machine WITH the package registry, every wheel that a GPU machine WITHOUT one needs to run this
# project and scripts/gpu_check.sh, into .whl/ (gitignored); carry the checkout with .whl/ to the GPU machine and
# run `bash scripts/gpu_check.sh` there: it installs from .whl/ what that machine lacks (pip --no-index).
#
#     bash scripts/fetch_wheels.sh                                     # for this interpreter and platform
#     bash scripts/fetch_wheels.sh --python 3.12 --platform manylinux_2_28_x86_64   # for another machine
#     bash scripts/fetch_wheels.sh --with-torch                        # + the pinned CPU torch and its dependencies
#     bash scripts/fetch_wheels.sh --dest /tmp/w --extras parquet      # elsewhere; with an extra of pyproject.toml
#
# What it fetches: pyproject.toml's dependencies (and the extras named) at the versions of the lock
# (requirements/constraints.txt, scripts/lock_deps.sh), with everything they need, as binary wheels only
# (--only-binary=:all:: pure-Python wheels serve any Python, the others are picked for --python/--platform); the
# project's own wheel (pip wheel --no-deps .); and .whl/requirements.txt, the requirements gpu_check.sh installs.
#
# torch is NOT fetched by default: the GPU machine brings its own CUDA build (the one this was written for: torch
# 2.11 + CUDA 13, Python 3.12), and a dependency's requirement on torch (torchdata's) must not pull one in. The
# resolve therefore sees a stand-in torch (an empty wheel made here, deleted after), so pip never resolves a real
# torch. --with-torch fetches TORCH_SPEC instead (default torch==2.13.0+cpu, the pin's CPU build: a local version
# label that no CUDA build carries, so pip cannot fall back to a multi-GB CUDA wheel; it comes from a --find-links
# folder that holds it, such as the pip configuration's, or from an index you add with PIP_EXTRA_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEST=$ROOT/.whl
PYVER=""
PLATFORM=""
WITH_TORCH=0
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
EXTRAS=""
PY=${PYTHON:-python3}
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
    --python) PYVER=$2; shift 2 ;;
    --platform) PLATFORM=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --with-torch) WITH_TORCH=1; shift ;;
    --torch-spec) TORCH_SPEC=$2; WITH_TORCH=1; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "fetch_wheels.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
case "$TORCH_SPEC" in
torch==*) ;;
*) echo "fetch_wheels.sh: --torch-spec must pin one version (torch==X), got '$TORCH_SPEC'" >&2; exit 2 ;;
esac

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST"
T0=$SECONDS

# The requirements: pyproject.toml's dependencies and the extras asked for, torch left out (gpu_check.sh installs
# these by name: what a machine already has stays as it is).
"$PY" - "$ROOT/pyproject.toml" "$EXTRAS" >"$TMP/requirements.txt" <<'EOF'
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    reqs += project["optional-dependencies"][extra]
for r in reqs:
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
    if name != "torch" and not r.startswith("titan_dmuon"):
        print(r)
EOF

PIP_TARGET_ARGS=()
[ -n "$PYVER" ] && PIP_TARGET_ARGS+=(--python-version "$PYVER" --implementation cp)
if [ -n "$PLATFORM" ]; then
    # pip takes a manylinux_2_N tag alone; a machine with glibc 2.N also runs every older manylinux wheel
    # (tokenizers' and grpcio's are manylinux_2_17): list them all, with the legacy aliases.
    PLATFORMS=$("$PY" - "$PLATFORM" <<'PYEOF'
import re
import sys

tag = sys.argv[1]
legacy = {"2014": 17, "2010": 12, "1": 5}
m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
n = re.fullmatch(r"manylinux(2014|2010|1)_(\w+)", tag)
if not (m or n):
    print(tag)
    raise SystemExit
glibc, arch = (int(m.group(1)), m.group(2)) if m else (legacy[n.group(1)], n.group(2))
for minor in range(glibc, 4, -1):
    print(f"manylinux_2_{minor}_{arch}")
for name, minor in legacy.items():
    if minor <= glibc:
        print(f"manylinux{name}_{arch}")
PYEOF
    )
    for p in $PLATFORMS; do PIP_TARGET_ARGS+=(--platform "$p"); done
fi

CONSTRAINTS=(-c "$ROOT/requirements/constraints.txt")
STUB_VERSION=""
if [ "$WITH_TORCH" = 1 ]; then
    echo "$TORCH_SPEC" >>"$TMP/requirements.txt"
    # the lock pins torch==2.13.0 (the CPU build's local label dropped); another pinned version replaces it
    grep -v -i '^torch==' "$ROOT/requirements/constraints.txt" >"$TMP/constraints.txt"
    echo "$TORCH_SPEC" >"$TMP/torch_pin.txt"
    CONSTRAINTS=(-c "$TMP/constraints.txt" -c "$TMP/torch_pin.txt")
else
    # The stand-in torch: an empty wheel of the lock's torch version with a local label of its own, the only
    # candidate its exact pin admits.
    STUB_VERSION="$(grep -i '^torch==' "$ROOT/requirements/constraints.txt" | head -1 | cut -d= -f3)+fetchwheelsstub"
    mkdir -p "$TMP/stub"
    "$PY" - "$TMP/stub" "$STUB_VERSION" <<'EOF'
import base64
import hashlib
import sys
import zipfile

folder, version = sys.argv[1:]
dist = f"torch-{version}.dist-info"
files = {
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: fetch_wheels.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append(f"{dist}/RECORD,,")
files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
with zipfile.ZipFile(f"{folder}/torch-{version}-py3-none-any.whl", "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
EOF
    echo "torch==$STUB_VERSION" >"$TMP/torch_pin.txt"
    CONSTRAINTS+=(-c "$TMP/torch_pin.txt")
fi

echo "fetch_wheels: into $DEST for Python ${PYVER:-$("$PY" -c 'import platform; print(platform.python_version())')}" \
    "on ${PLATFORM:-this platform}; torch: $([ "$WITH_TORCH" = 1 ] && echo "$TORCH_SPEC" || echo "not fetched (the GPU machine's own)")"
sed 's/^/  requirement: /' "$TMP/requirements.txt"
FIND_STUB=()
[ -n "$STUB_VERSION" ] && FIND_STUB=(--find-links "$TMP/stub")
"$PY" -m pip download -q --only-binary=:all: --dest "$DEST" "${PIP_TARGET_ARGS[@]}" "${FIND_STUB[@]}" \
    "${CONSTRAINTS[@]}" -r "$TMP/requirements.txt"
if [ -n "$STUB_VERSION" ]; then
    rm -f "$DEST"/torch-*fetchwheelsstub*.whl
fi

# The project's own wheel (pure Python): `pip install --no-index --no-deps --find-links .whl titan_dmuon` on the
# GPU machine if it should be installed rather than run from the checkout (gpu_check.sh runs it from the checkout).
rm -f "$DEST"/titan_dmuon-*.whl
"$PY" -m pip wheel -q --no-deps --wheel-dir "$DEST" "$ROOT"
rm -rf "$ROOT/build"

grep -v '^torch==' "$TMP/requirements.txt" >"$DEST/requirements.txt"
if [ "$WITH_TORCH" = 1 ]; then echo "$TORCH_SPEC" >"$DEST/torch.txt"; else rm -f "$DEST/torch.txt"; fi

# What must not be there: a CUDA torch or its NVIDIA libraries, unless asked for.
if [ "$WITH_TORCH" = 0 ] && ls "$DEST" | grep -qiE '^(torch-|nvidia_|triton-)'; then
    echo "fetch_wheels: FAIL: a torch/NVIDIA wheel was fetched without --with-torch: $(ls "$DEST" | grep -iE '^(torch-|nvidia_|triton-)' | tr '\n' ' ')" >&2
    exit 1
fi
if [ "$WITH_TORCH" = 1 ] && ls "$DEST" | grep -qiE '^nvidia_'; then
    echo "fetch_wheels: FAIL: NVIDIA wheels were fetched with $TORCH_SPEC (a CUDA build?)" >&2
    exit 1
fi
echo "fetch_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST ($((SECONDS - T0)) s)"
