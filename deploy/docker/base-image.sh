#!/usr/bin/env bash
# Makes the Debian 12 base image locally, for machines that cannot pull from a
# public registry: a minimal bookworm root (mmdebstrap's minbase variant, the
# same package set as debian:bookworm-slim, without docs, man pages and
# locales) imported with `docker import`.
#
#   deploy/docker/base-image.sh [TAG]        # default: pstrain-local/debian:bookworm-slim
#   docker build --network host --build-arg BASE_IMAGE=pstrain-local/debian:bookworm-slim \
#     -f deploy/docker/Dockerfile.server -t pstrain-server .
#
# The root carries this host's apt sources and its /etc/apt/apt.conf.d/99*
# settings (proxies, mirrors, snapshot options) so that `apt-get` in a build
# reaches the same Debian registry the host does (build with --network host).
# That configuration belongs to this machine: the image is for local builds
# only and is never pushed. Images for users build FROM the public
# debian:bookworm-slim (the Dockerfiles' default), which knows nothing of it.
#
# Needs root (or sudo), mmdebstrap and a Docker client. Environment:
#   DOCKER       the Docker client (default: docker)
#   DOCKER_HOST  as for docker itself
set -euo pipefail
TAG=${1:-pstrain-local/debian:bookworm-slim}
DOCKER=${DOCKER:-docker}

command -v mmdebstrap >/dev/null ||
  { echo "base-image: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
# The host's Debian sources: Debian's own file names first, then whatever the
# host's apt reads (a root made by mmdebstrap, for one, names its file
# sources.list.d/0000<name>.sources).
SOURCES=""
shopt -s nullglob
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list \
  /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
  if [[ -s $f ]] && grep -qE '^[[:space:]]*(deb|Types:)' "$f"; then SOURCES=$f; break; fi
done
[[ -n $SOURCES ]] || {
  echo "base-image: no apt sources on this host (looked in /etc/apt/sources.list and /etc/apt/sources.list.d/)" >&2
  exit 1
}

# Host apt settings copied in (names kept, so they read as what they are).
HOOKS=()
for f in /etc/apt/apt.conf.d/99*; do
  HOOKS+=(--customize-hook="copy-in $f /etc/apt/apt.conf.d")
done
# What debian:bookworm-slim leaves out.
DPKG_OPTS=()
for path in '/usr/share/doc/*' '/usr/share/man/*' '/usr/share/info/*' '/usr/share/locale/*' \
  '/usr/share/lintian/*' '/usr/share/linda/*'; do
  DPKG_OPTS+=(--dpkgopt="path-exclude=$path")
done
DPKG_OPTS+=(--dpkgopt="path-include=/usr/share/doc/*/copyright")

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO=sudo
TARBALL=$(mktemp /tmp/pstrain-base.XXXXXX.tar)
# mmdebstrap merges /usr with usrmerge, which brings perl along: about 50 MB
# that debian:bookworm-slim does not carry. Once /usr is merged,
# usr-is-merged stands in for it and perl can go (perl-base stays).
DROP_PERL=$(mktemp /tmp/pstrain-base-hook.XXXXXX)
trap 'rm -f "$TARBALL" "$DROP_PERL"' EXIT
cat >"$DROP_PERL" <<'HOOK'
#!/bin/sh
set -e
root=$1
perl=$(chroot "$root" dpkg-query -W -f '${db:Status-Abbrev} ${Package}\n' perl 'perl-modules-*' \
  'libperl5*' 'lib*-perl' 2>/dev/null | awk '$1 == "ii" {print $2}')
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get purge -y -q usrmerge $perl >/dev/null
HOOK
chmod +x "$DROP_PERL"
echo "base-image: building $TAG from $SOURCES"
# Into a file first: a failed mmdebstrap must not leave a half image behind.
$SUDO mmdebstrap --quiet --variant=minbase --format=tar --include=usr-is-merged \
  "${DPKG_OPTS[@]}" "${HOOKS[@]}" --customize-hook="$DROP_PERL" \
  --customize-hook='rm -f "$1"/etc/hostname "$1"/etc/resolv.conf' \
  bookworm - "$SOURCES" >"$TARBALL"
"$DOCKER" import \
  --change 'CMD ["bash"]' \
  --change 'LABEL org.opencontainers.image.description="Debian 12 minbase made by pstrain deploy/docker/base-image.sh: carries the build host apt configuration, local use only"' \
  "$TARBALL" "$TAG" >/dev/null
echo "base-image: $TAG ($("$DOCKER" image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
