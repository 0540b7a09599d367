#!/usr/bin/env bash
# The base image `make image` builds FROM (BASE, default debian:bookworm-slim), made usable:
#
#   bash scripts/base_image.sh debian:bookworm-slim
#
# 1. A local image of that name is kept only if it runs /bin/sh: an empty or broken one (say, an
#    earlier `docker import` of an empty stream) is removed and made again, never reused.
# 2. Else it is pulled.
# 3. Else (no registry reachable) it is made here: mmdebstrap writes a minbase bookworm tarball to
#    a file (not a pipe, so its failure is seen), the tarball must hold bin/sh, and only then is it
#    imported and tagged. Without mmdebstrap it stops at once, saying what to install, and tags
#    nothing: after `apt-get install mmdebstrap` the next `make image` just works.
set -euo pipefail

BASE=${1:?usage: base_image.sh IMAGE}
SUITE=${SUITE:-bookworm}
say() { echo "[image] $*"; }
die() { echo "[image] $*" >&2; exit 1; }

command -v docker >/dev/null || die "docker is missing: install a Docker engine (Debian: apt-get install docker.io; then dockerd &)"
docker info >/dev/null 2>&1 || die "no Docker engine answers: start one (as root: dockerd > /var/log/dockerd.log 2>&1 &)"

runs_sh() { docker run --rm --network none --entrypoint /bin/sh "$1" -c true >/dev/null 2>&1; }

if docker image inspect "$BASE" >/dev/null 2>&1; then
  if runs_sh "$BASE"; then
    exit 0
  fi
  say "$BASE exists but cannot run /bin/sh (an empty or broken image): removing it and making it again"
  docker image rm -f "$BASE" >/dev/null
fi

if docker pull -q "$BASE" >/dev/null 2>&1; then
  runs_sh "$BASE" && { say "$BASE pulled"; exit 0; }
  docker image rm -f "$BASE" >/dev/null
  die "$BASE was pulled but cannot run /bin/sh: pass BASE= an image with a shell"
fi

case "$BASE" in
  debian:"$SUITE"*) ;;
  *) die "$BASE is not here and cannot be pulled; only debian:$SUITE* can be made locally (mmdebstrap): pull or load $BASE, or leave BASE at its default" ;;
esac
command -v mmdebstrap >/dev/null || die "$BASE cannot be pulled and mmdebstrap (which makes it locally) is missing: install it (Debian: apt-get install mmdebstrap), then run make image again"

say "$BASE cannot be pulled: making it locally (mmdebstrap --variant=minbase $SUITE, then docker import)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mmdebstrap --quiet --variant=minbase "$SUITE" "$work/base.tar" || die "mmdebstrap failed (see above): nothing was tagged"
# A root filesystem holds a shell; anything less is not a base, whatever mmdebstrap's status said.
# (the listing goes to a file: grep -q would close the pipe early and pipefail read tar's SIGPIPE)
tar -tf "$work/base.tar" > "$work/list"
grep -qxE '(\./)?(usr/)?bin/sh' "$work/list" \
  || die "mmdebstrap's tarball has no /bin/sh: nothing was tagged"
docker import "$work/base.tar" "$BASE" >/dev/null
runs_sh "$BASE" || { docker image rm -f "$BASE" >/dev/null; die "the imported $BASE cannot run /bin/sh: removed"; }
say "$BASE made locally"
