#!/usr/bin/env bash
# One command run in two source trees in turn, side by side on one machine (e.g. within one GPU device call):
# BASE, an earlier commit's tree, and this checkout (HEAD). The base runs from inside its tree (the current
# folder comes first on sys.path, before an editable install); without its own specchat/data it borrows this
# checkout's (2 MB of code carries to a GPU machine, 29 MB of data need not).
#
#   mkdir -p .ab_base && git archive BASE | tar -x --exclude=specchat/data -C .ab_base   # git-ignored
#   BASE_TREE=.ab_base ROUNDS=2 bash benchmarks/ab_trees.sh python -m specchat bench --synthetic ...
#
# More trees: TREES="base=.ab_base variant=.ab_prev head=." (label=folder ...) instead of BASE_TREE.
# Rounds rotate the order (base first, then head first, ...) so that a warm-up or drift favours none.
# Each run's output is prefixed with "[base N]" / "[head N]"; when OUT is set the command sees
# OUT=$OUT/ab_<label>_<round>, so runs that write files do not overwrite each other.
set -uo pipefail
TREES=${TREES:-base=${BASE_TREE:?BASE_TREE=<folder with the base commit\'s specchat/> or TREES=\"label=folder ...\"} head=.}
ROUNDS=${ROUNDS:-2}
[ $# -gt 0 ] || { echo "usage: BASE_TREE=DIR [ROUNDS=N] bash benchmarks/ab_trees.sh COMMAND..." >&2; exit 2; }
read -ra trees <<< "$TREES"
for entry in "${trees[@]}"; do
  tree=${entry#*=}
  [ -d "$tree/specchat" ] || { echo "ab_trees: $tree/specchat is missing" >&2; exit 2; }
  [ -e "$tree/specchat/data" ] || ln -s "$PWD/specchat/data" "$tree/specchat/data"
done
run() {  # label tree round command...
  local label=$1 tree=$2 round=$3
  shift 3
  local out=""
  [ -n "${OUT:-}" ] && out="$(cd "$OUT" && pwd)/ab_${label}_$round" && mkdir -p "$out"
  echo "=== [$label $round] $(date -u +%T) in $tree: $*"
  (cd "$tree" && PYTHONPATH=. OUT="$out" "$@") 2>&1 | sed "s/^/[$label $round] /"
}
n=${#trees[@]}
for ((round = 1; round <= ROUNDS; round++)); do
  for ((i = 0; i < n; i++)); do  # odd rounds in the given order, even ones reversed
    entry=${trees[$(( round % 2 ? i : n - 1 - i ))]}
    run "${entry%%=*}" "${entry#*=}" "$round" "$@"
  done
done
