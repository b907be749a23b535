#!/usr/bin/env bash
# A slim branch for a GPU lease (scripts/gpu_train_drafters.py): a lease call sends the checkout's tracked files
# along with what it carries, 64 MiB in all, and the full tree (release drafters, results, prompt files) is ~100 MB.
# This commits, without touching the work tree or the index, a branch holding only what the lease runs: the package
# minus its shipped release folders, the lease script and the training data folders; then prints the sizes each call
# would send.
#
#   bash scripts/gpu_slim_branch.sh [BRANCH] [DATA_FOLDER ...]
#   git checkout gpu-lease        # before the lease calls (untracked, git-ignored .gpu/ and .whl/ stay)
#   git checkout main             # after them
set -euo pipefail
branch="${1:-gpu-lease}"
shift || true
data=("$@")
[ ${#data[@]} -eq 0 ] && data=(data/smollm2-135m-12k data/smollm2-135m-20k)
cd "$(git rev-parse --show-toplevel)"
for d in "${data[@]}"; do
  [ -d "$d" ] || { echo "error: data folder $d not found" >&2; exit 2; }
done
index="$(mktemp)"
trap 'rm -f "$index"' EXIT
export GIT_INDEX_FILE="$index"
git read-tree --empty
# HEAD's entries under these paths ("mode type sha<TAB>path", what --index-info reads), the release folders left out
git ls-tree -r -z HEAD -- src setup.cfg pyproject.toml scripts/gpu_train_drafters.py "${data[@]}" \
  | grep -z -v $'\tsrc/dspark_hf/testbed/releases/' \
  | git update-index -z --index-info
tree="$(git write-tree)"
commit="$(git commit-tree "$tree" -p HEAD -m "slim tree for a GPU lease (scripts/gpu_slim_branch.sh): ${data[*]}")"
git branch -f "$branch" "$commit" >/dev/null
unset GIT_INDEX_FILE
bytes="$(git ls-tree -r -l "$branch" | awk '{s += $4} END {print s}')"
files="$(git ls-tree -r --name-only "$branch" | wc -l)"
echo "$branch: $files files, $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}') MiB) sent by every call"
untracked="$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)"
untracked="${untracked:-0}"
if [ "$untracked" -gt 0 ]; then
  echo "untracked files not ignored by git travel too: $untracked bytes (commit or move them first)"
  bytes=$((bytes + untracked))
fi
limit=$((64 * 1024 * 1024))
for carried in ".whl .gpu/target.gguf.part00" ".gpu/target.gguf.part01 .gpu/target.gguf.part02 .gpu/generate.jsonl.gz"; do
  size=0
  for f in $carried; do
    [ -e "$f" ] && size=$((size + $(du -sb "$f" | cut -f1)))
  done
  total=$((size + bytes))
  verdict="fits"
  [ "$total" -gt "$limit" ] && verdict="TOO BIG"
  echo "call carrying [$carried]: $total of $limit bytes: $verdict"
done
