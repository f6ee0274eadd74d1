#!/usr/bin/env bash
# The packages the GPU machine's image lacks for `serve_8b.sh http` (FastAPI, uvicorn and what they need beyond
# the image's own), packed for a device call. A call's working tree may hold 64 MiB and the repository's tracked
# files take about 62, so they travel unpacked and xz-compressed (1.9 MB, against 3.1 as wheels):
#     benchmarks/device_site.sh     # here, where pip reaches PyPI: writes .wsite/site.tar.xz (ignored by git)
#     # there, first thing in the call (carry [".wsite"]):
#     mkdir -p /tmp/site && tar -C /tmp/site -xJf .wsite/site.tar.xz && export PYTHONPATH=/tmp/site:.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
packages=(fastapi==0.165.0 uvicorn==0.55.0 httptools==0.9.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
          annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2)
wheels=$(mktemp -d) site=$(mktemp -d)
trap 'rm -rf "$wheels" "$site"' EXIT
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$wheels" "${packages[@]}"
for wheel in "$wheels"/*.whl; do
  unzip -q -o "$wheel" -d "$site"
done
# Not needed to import and serve: type stubs, fastapi's notes for coding agents, install records, bills of materials, the packages' long
# descriptions (importlib.metadata reads the headers above them), pydantic's v1 (fastapi imports it only to
# recognise v1 models, and goes on without it).
find "$site" \( -name "*.pyi" -o -name RECORD \) -delete
rm -rf "$site"/pydantic/v1 "$site"/*.dist-info/sboms "$site"/fastapi/.agents
for metadata in "$site"/*.dist-info/METADATA; do
  sed -i '/^$/,$d' "$metadata"
done
mkdir -p .wsite
XZ_OPT=-9e tar -C "$site" -cJf .wsite/site.tar.xz .
grep -qx "/.wsite/" .git/info/exclude || echo "/.wsite/" >> .git/info/exclude
ls -l .wsite/site.tar.xz
