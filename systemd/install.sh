#!/bin/sh
# Install edge-agent as a systemd service. Idempotent: run it again after an upgrade.
#   sudo systemd/install.sh [VENV]        (VENV default: the repository's .venv)
# Creates the edge-agent user and group, /etc/edge-agent (config, credentials: each 0600
# edge-agent), /etc/edge-agent/trusted_keys (root's), /var/lib/edge-agent (state, 0700),
# links /usr/local/bin/edge-agent, installs the unit.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-"$here/../.venv"}
venv=$(cd "$venv" && pwd)
root=${DESTDIR:-}

if [ ! -x "$venv/bin/edge-agent" ]; then
    echo "install.sh: $venv/bin/edge-agent is missing: pip install -e . in that venv first" >&2
    exit 2
fi

if ! getent group edge-agent >/dev/null; then
    groupadd --system edge-agent
fi
if ! getent passwd edge-agent >/dev/null; then
    useradd --system --gid edge-agent --home-dir /var/lib/edge-agent --no-create-home \
        --shell /usr/sbin/nologin --comment "edgetrain edge agent" edge-agent
fi
# GPU device nodes on Jetson belong to video/render; the jetson-stats service lets its jtop
# group switch power modes (the unit has no root to run nvpmodel -m itself). Re-run this after
# installing jetson-stats.
for g in video render jtop; do
    if getent group "$g" >/dev/null; then usermod -a -G "$g" edge-agent; fi
done

install -d -m 0750 -o root -g edge-agent "$root/etc/edge-agent"
# Trusted keys: root's to write, nobody else's (the agent refuses a folder others can write).
install -d -m 0755 -o root -g root "$root/etc/edge-agent/trusted_keys"
# State: the service user's alone (0700); data sets a command may name live under data/.
install -d -m 0700 -o edge-agent -g edge-agent "$root/var/lib/edge-agent"
install -d -m 0700 -o edge-agent -g edge-agent "$root/var/lib/edge-agent/data"
if [ ! -e "$root/etc/edge-agent/agent.yaml" ]; then
    install -m 0640 -o root -g edge-agent "$here/agent.example.yaml" \
        "$root/etc/edge-agent/agent.yaml"
    echo "install.sh: wrote /etc/edge-agent/agent.yaml: set device_id and mqtt before starting"
fi
install -d "$root/usr/local/bin"
ln -sfn "$venv/bin/edge-agent" "$root/usr/local/bin/edge-agent"
install -m 0644 "$here/edge-agent.service" "$root/etc/systemd/system/edge-agent.service"

if [ -z "$root" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable edge-agent.service
    echo "install.sh: enabled; start with: systemctl start edge-agent"
else
    echo "install.sh: unit installed (systemd not running here: not enabled)"
fi
