#!/usr/bin/env bash
# The full release matrix at one commit, then the report: compat/one_commit.sh does it.
#   bash compat/run_matrix.sh [-j JOBS] [--resume] [RELEASE ...]
exec bash "$(dirname "$0")/one_commit.sh" "$@"
