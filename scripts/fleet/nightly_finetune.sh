#!/usr/bin/env bash
# Nightly fine-tune of one group on its own local data (cron: 0 2 * * *). The plan lives in
# a YAML file next to this script so the reviewable knobs are in one place; the date makes
# each night's rollout name unique. Uses fleetctl only.
#
#   scripts/fleet/nightly_finetune.sh scripts/fleet/nightly_finetune.yaml
set -euo pipefail
plan=${1:-$(dirname "$0")/nightly_finetune.yaml}
fleetctl=${FLEETCTL:-fleetctl}
report_dir=${FLEETCTL_REPORT_DIR:-/var/lib/fleetctl/reports}

# A rollout left running by a crashed run of last night is finished first.
"$fleetctl" --report-dir "$report_dir" controller || true
"$fleetctl" --report-dir "$report_dir" rollout create --plan "$plan" \
  --name "nightly-$(date -u +%Y%m%d)"
