#!/usr/bin/env bash
# For `make sanitize-thread`: CAF's core library built with ThreadSanitizer, from Debian's own source
# of the installed version (apt-get source actor-framework), into DEST/lib. The suites then load it
# instead of Debian's uninstrumented libcaf_core.so (LD_LIBRARY_PATH), so that TSan sees the
# release/acquire of CAF's mailboxes and reference counts: without it every message handed from
# one thread to another through an actor looks like a race. Built once; ~5 minutes on 2 cores.
#   scripts/build_caf_tsan.sh DEST
set -euo pipefail
dest=$(realpath -m "$1")
version=$(dpkg-query -W -f='${Version}' libcaf-dev | sed 's/-.*//')
[ -f "$dest/lib/libcaf_core.so.$version" ] && exit 0
mkdir -p "$dest/src"
cd "$dest/src"
if [ ! -f "actor-framework_${version}.orig.tar.gz" ]; then
  if ! apt-cache showsrc actor-framework > /dev/null 2>&1 || ! apt-cache showsrc actor-framework | grep -q .; then
    # Debian's source index: the same mirror as the binary packages, deb-src instead of deb.
    echo "shardflow: adding Debian's source index (deb-src) to fetch CAF's source"
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      > /etc/apt/sources.list.d/shardflow-src.sources
    apt-get update -qq
  fi
  # Only the upstream tarball is needed (Debian's packaging tarball may be gone from the mirror).
  apt-get source -qq --download-only actor-framework || true
fi
[ -f "actor-framework_${version}.orig.tar.gz" ] || { echo "build_caf_tsan: could not fetch CAF ${version}'s source" >&2; exit 1; }
rm -rf "actor-framework-${version}"
tar xzf "actor-framework_${version}.orig.tar.gz"
# Debian's build_config.hpp (log level quiet, no runtime checks) is what these options generate:
# the instrumented library is a drop-in for the installed headers. A unity build (16 files a
# translation unit): the whole script took 94 s on 2 cores, about 166 s one file at a time
# (2026-12-03, CI's 45 minutes).
cmake -S "actor-framework-${version}" -B build -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -O1 -g1 -w" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 \
  -DCAF_NO_IO=yes -DCAF_NO_EXAMPLES=yes -DCAF_NO_UNIT_TESTS=yes -DCAF_NO_OPENCL=yes -DCAF_NO_OPENSSL=yes \
  -DCAF_NO_TOOLS=yes -DCAF_NO_PYTHON=yes -DCAF_NO_SUMMARY=yes -DCAF_NO_COMPILER_CHECK=yes > /dev/null
diff <(sed -n '/#pragma once/,$p' build/libcaf_core/caf/detail/build_config.hpp) \
     <(sed -n '/#pragma once/,$p' /usr/include/caf/detail/build_config.hpp) > /dev/null ||
  { echo "build_caf_tsan: the instrumented CAF's build_config.hpp differs from Debian's" >&2; exit 1; }
cmake --build build -j "${JOBS:-2}" --target libcaf_core_shared
mkdir -p "$dest/lib"
cp -a build/lib/libcaf_core.so* "$dest/lib/"
