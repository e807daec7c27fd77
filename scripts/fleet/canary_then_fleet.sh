#!/usr/bin/env bash
# Deploy a registry version to a group: one canary, then 5%, 25% and the whole group, each
# wave baking 10 minutes; abort (and roll back whoever committed) on >10% failures or a
# median eval/acc drop above 2 points. Copy and edit; it uses fleetctl only.
#
#   FLEETCTL_HOST=broker.example FLEETCTL_PORT=8883 FLEETCTL_TLS_CA=ca.pem \
#   FLEETCTL_TLS_CERT=ops.pem FLEETCTL_TLS_KEY=ops.key \
#     scripts/fleet/canary_then_fleet.sh line-3 digits 2026-11-23
set -euo pipefail
group=${1:?usage: $0 GROUP MODEL VERSION}
model=${2:?usage: $0 GROUP MODEL VERSION}
version=${3:?usage: $0 GROUP MODEL VERSION}
fleetctl=${FLEETCTL:-fleetctl}

"$fleetctl" devices --group "$group"
# The controller runs in the foreground (progress bars at a terminal, JSON lines otherwise)
# and exits 0 only if every wave finished and no device failed. If this shell dies, the
# rollout is not lost: `fleetctl controller` resumes it where it was.
"$fleetctl" rollout create \
  --name "deploy-${model}-${version//[^A-Za-z0-9._-]/-}" \
  --group "$group" --job deploy --args "{\"name\": \"$model\", \"version\": \"$version\"}" \
  --waves 1,5%,25%,100% --bake-s 600 --max-per-minute 60 \
  --abort-failure-rate 0.1 --min-completed 5 \
  --abort-metric eval/acc --max-metric-drop 0.02 \
  --timeout-s 3600 --retries 1
