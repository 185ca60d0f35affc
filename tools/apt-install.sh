#!/usr/bin/env bash
# tools/apt-install.sh [--with-recommends] PACKAGE...: `apt-get update` and `apt-get install`
# of Debian packages, as root, one caller at a time. The scripts that install what they miss
# (tools/k8s/node-packages.sh, tools/image/build.sh, tools/kind/) may run side by side (make
# test's two lanes, a kind build beside CI): each takes this lock for its whole update and
# install, and apt itself waits up to 10 min for a dpkg lock that anything else holds, where a
# second apt-get would fail at once with "Unable to acquire the dpkg frontend lock".
set -euo pipefail
recommends=--no-install-recommends
if [ "${1:-}" = --with-recommends ]; then recommends=; shift; fi
[ $# -gt 0 ] || { echo "usage: $0 [--with-recommends] PACKAGE..." >&2; exit 2; }
exec 9>/var/lock/matrixpool-apt.lock
flock 9
apt=(apt-get -q -o DPkg::Lock::Timeout=600)
"${apt[@]}" update >/dev/null
# shellcheck disable=SC2086  # $recommends is one flag or none
DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y $recommends "$@" >/dev/null
