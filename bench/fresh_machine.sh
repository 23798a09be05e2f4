#!/usr/bin/env bash
# The README's main command on a fresh Debian 12: a fresh clone of HEAD, run with `scripts/demo` inside a
# container that has Python and sshd only (tests/ansible/build-host-image bare: debootstrap minbase, no
# rsync, pip, sudo or systemd), on the host's network. Prints the time to the play's end and its exit
# code. As root, on a machine with podman and debootstrap (scripts/setup-system). 15-25 minutes: the
# container downloads everything (Debian packages, .venv, the wheel cache) and SmolLM2 writes the demo's
# dataset on the CPU.
#
#   bench/fresh_machine.sh [LOG]          (default log: build/fresh-machine.log)
#
# What the container is given from this machine, because they are this machine's and not the project's:
# the CA bundle (a TLS-inspecting egress needs it) and a local wheel folder named by PIP_FIND_LINKS (here
# the CPU build of torch lies there). Nothing else: no venv, no wheel cache, no apt cache.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log="${1:-$root/build/fresh-machine.log}"
mkdir -p "$(dirname "$log")"
export CONTAINERS_CONF="$root/tests/ansible/podman/containers.conf"
export CONTAINERS_STORAGE_CONF="$root/tests/ansible/podman/storage.conf"
"$root/tests/ansible/build-host-image" bare
work="$(mktemp -d)"
name="dflash-fresh-$$"
trap 'podman rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git clone -q "$root" "$work/repo"
args=(--rm --name "$name" --network host -v "$work/repo:/repo" -w /repo)
ca="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
if [ -f "$ca" ]; then
  args+=(-v "$ca:/tmp/host-ca.crt:ro" -e PIP_CERT=/tmp/host-ca.crt -e SSL_CERT_FILE=/tmp/host-ca.crt
    -e REQUESTS_CA_BUNDLE=/tmp/host-ca.crt)
fi
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
  args+=(-v "$PIP_FIND_LINKS:$PIP_FIND_LINKS:ro" -e "PIP_FIND_LINKS=$PIP_FIND_LINKS")
fi
echo "fresh-machine: scripts/demo in a bare Debian 12 container on $(git -C "$root" rev-parse --short HEAD); log: $log" >&2
start=$(date +%s)
rc=0
podman run "${args[@]}" dflash-bare-host bash -c 'scripts/demo' >"$log" 2>&1 || rc=$?
took=$(($(date +%s) - start))
grep -A4 "TASK \[Say where to watch it\]" "$log" | sed -n 's/^ *- //p' | head -2 >&2 || true
printf 'fresh-machine: scripts/demo exit %d in %d min %02d s\n' "$rc" $((took / 60)) $((took % 60))
exit "$rc"
