#!/usr/bin/env bash
# `make protos-check`: buf lint, then buf breaking of protos/ as it is in this checkout (uncommitted edits
# included) against protos/ as committed on the base branch (PROTOS_BASE, default main).
#
# The base is the local branch if there is one, else origin/<base> (a clone made with --branch X, a CI
# checkout of a pull request), else <base> as any revision (a tag, a commit). With none of them (a tarball,
# a single-branch fetch of another branch) the breaking check is skipped with a message saying so, or fails
# when PROTOS_BASE_REQUIRED=1. On the base branch itself it checks the uncommitted edits.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=${PROTOS_BASE:-main}
buf=${BUF:-buf}

"$buf" lint "$root/protos"

commit=""
if git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
	for ref in "refs/heads/$base" "refs/remotes/origin/$base" "$base"; do
		if commit=$(git -C "$root" rev-parse -q --verify "$ref^{commit}" 2>/dev/null); then
			break
		fi
	done
fi
if [[ -z $commit ]]; then
	message="protos-check: no '$base' or 'origin/$base' in this checkout to compare against"
	if [[ ${PROTOS_BASE_REQUIRED:-0} == 1 ]]; then
		echo "$message (git fetch origin $base:$base)" >&2
		exit 1
	fi
	echo "$message: buf breaking SKIPPED (git fetch origin $base:$base enables it)"
	exit 0
fi

against=$(mktemp -d)
trap 'rm -rf "$against"' EXIT
git -C "$root" archive "$commit" protos | tar -x -C "$against"
echo "buf breaking: protos/ against $ref (${commit:0:12})"
"$buf" breaking "$root/protos" --against "$against/protos"
