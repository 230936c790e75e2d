#!/usr/bin/env bash
# Runs a command with the real services available: reuses running ones (their
# RANKMETER_* settings from the harness), otherwise starts them and stops them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RANKMETER_KAFKA_BOOTSTRAP_SERVERS:-}" ] || [ -z "${RANKMETER_REDIS_URL:-}" ]; then
    if ! scripts/services.sh status; then
        trap 'scripts/services.sh down' EXIT
        scripts/services.sh up >/dev/null
    fi
    set -a
    eval "$(scripts/services.sh env)"
    set +a
fi
"$@"
