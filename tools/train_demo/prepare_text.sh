#!/usr/bin/env bash
# Gathers the demo model's training text from Debian packages (all public domain or freely
# redistributable prose): Jane Austen's novels (r-cran-janeaustenr, as laid out in ../shared/data/
# janeausten), the Jargon File (jargon-text), The Devil's Dictionary (dict-devil) and the fortune
# cookie files (fortunes, fortunes-min; without ascii-art). Usage: prepare_text.sh OUT_DIR [AUSTEN_DIR]
set -euo pipefail
out=$(realpath -m "$1")
austen=${2:-$(dirname "$0")/../../../shared/data/janeausten}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download fortunes fortunes-min jargon-text dict-devil >/dev/null)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/x"; done
zcat "$work/x/usr/share/doc/jargon-text/jargon.txt.gz" > "$out/jargon.txt"
zcat "$work/x/usr/share/dictd/devil.dict.dz" > "$out/devil.txt"
fortunes="$work/x/usr/share/games/fortunes"
for f in $(ls "$fortunes" | grep -v -e '\.dat$' -e '\.u8$' -e '^ascii-art$'); do
  [ -f "$fortunes/$f" ] && grep -v '^%$' "$fortunes/$f" || true
done > "$out/fortunes.txt"
cp "$austen"/*.txt "$out/"
wc -c "$out"/*.txt
