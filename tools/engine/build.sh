#!/usr/bin/env bash
# Builds the real inference engine of the tests and the serving benchmark: llama.cpp's
# server (llama-server), from the llama.cpp source that PyPI's llama-cpp-python sdist vendors
# (pinned below, its sha256 checked): no other source is reachable from the build machines.
# CPU only, statically linked against its own ggml, no curl, no OpenSSL; -march=native (the
# cache is this machine's: the key names the CPU's flags).
#
# Called by `make engine` (and so `make test`), by the integration tests and by
# benchmarks/serving.py. Prints progress on stderr while a cold build runs (~7 min on 2 cores)
# and the binary's path as its last line on stdout.
#
# Cache (MATRIXPOOL_CACHE, default ~/.cache/matrixpool):
#   engine/llama-server-<key>/llama-server   <key> hashes the pin, the build flags, this script
#                                            and the CPU flags
#   engine/src/<sdist>                       the sdist, downloaded once
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python; vendors llama.cpp's ggml 0.25.3
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON)

script=$(realpath "$0")
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}/engine
cpu=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-8)
key=$( (echo "$VERSION $SHA256 ${FLAGS[*]} $cpu"; cat "$script") | sha256sum | cut -c1-12)
slot=$cache/llama-server-$key
if [[ -x $slot/llama-server ]]; then
  echo "$slot/llama-server"
  exit 0
fi

started=$SECONDS
log() { printf '[engine %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }
mkdir -p "$cache/src"
exec 9>"$cache/.lock"
if ! flock -n 9; then
  log "another build is running; waiting for it"
  flock 9
  [[ -x $slot/llama-server ]] && { echo "$slot/llama-server"; exit 0; }
fi

sdist=$cache/src/llama_cpp_python-$VERSION.tar.gz
if ! echo "$SHA256  $sdist" | sha256sum -c --quiet 2>/dev/null; then
  log "downloading llama-cpp-python $VERSION (the sdist, ~77 MB)"
  pip=${PIP:-$(dirname "$script")/../../.venv/bin/pip}
  [[ -x $pip ]] || pip="python3 -m pip"
  $pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$cache/src" 2>&1 | tail -n 5 >&2 || true
  echo "$SHA256  $sdist" | sha256sum -c --quiet || { log "FAILED: $sdist missing or not the pinned sha256"; exit 1; }
fi

work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "unpacking llama.cpp from $(basename "$sdist")"
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
source=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
cmake -S "$source" -B "$work/build" "${FLAGS[@]}" >"$work/configure.log" 2>&1 ||
  { log "FAILED: cmake configure; last lines:"; tail -n 40 "$work/configure.log" >&2; exit 1; }

# The build, with a line every 30 s of how far ninja got ("[n/total]").
log "building llama-server (cmake + ninja, $(nproc) jobs)"
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "  ... $(grep -o '^\[[0-9]*/[0-9]*\]' "$work/build.log" | tail -n 1) compiled"
  fi
done
if ! wait "$pid"; then
  log "FAILED: the build; last lines:"
  tail -n 40 "$work/build.log" >&2
  exit 1
fi
mkdir -p "$slot.tmp"
cp "$work/build/bin/llama-server" "$slot.tmp/"
rm -rf "$slot" && mv "$slot.tmp" "$slot"
log "llama-server built in $((SECONDS - started)) s"
echo "$slot/llama-server"
