#!/usr/bin/env bash
# Regenerates the committed Python modules of the kubelet device plugin API,
# operator/matrixpool/deviceplugin/api_pb2.py, api_pb2.pyi and api_pb2_grpc.py, from
# tools/deviceplugin/api.proto, with grpcio-tools $GRPCIO_TOOLS_VERSION installed into a
# throwaway venv (not a dependency of the project). The generated code checks at import that the
# installed grpcio and protobuf are at least what generated it: after changing the version here,
# raise the grpcio and protobuf lower bounds in pyproject.toml to match (protobuf: the
# "Protobuf Python Version" in api_pb2.py's header).
#
#   tools/deviceplugin/generate.sh            # PYTHON=python3.11 to choose the interpreter
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
version=${GRPCIO_TOOLS_VERSION:-1.85.1}
python=${PYTHON:-python3}
package=matrixpool/deviceplugin  # where the modules go under operator/; also their import path

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "grpcio-tools==$version"

# The proto sits at its package path, so that the service module imports its messages as
# `from matrixpool.deviceplugin import api_pb2`. gogoproto options (older kubelet releases have
# them) mean nothing to Python and would need gogo.proto: drop them.
mkdir -p "$work/src/$package" "$work/out"
sed -e '/gogoproto\/gogo\.proto/d' \
    -e '/^option (gogoproto\./d' \
    -e 's/ *\[(gogoproto\.[^]]*\]//' \
    "$here/api.proto" > "$work/src/$package/api.proto"

"$work/venv/bin/python" -m grpc_tools.protoc \
    --proto_path="$work/src" \
    --python_out="$work/out" \
    --pyi_out="$work/out" \
    --grpc_python_out="$work/out" \
    "$package/api.proto"

cp "$work/out/$package/api_pb2.py" "$work/out/$package/api_pb2.pyi" \
   "$work/out/$package/api_pb2_grpc.py" "$root/operator/$package/"
echo "generated operator/$package/api_pb2.py, api_pb2.pyi, api_pb2_grpc.py (grpcio-tools $version)"
