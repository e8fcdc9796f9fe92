#!/usr/bin/env bash
# Runs the client-side tests of turboquant-serve against the binary given as the argument:
#   tests/serve/run.sh build/bin/turboquant-serve
# conformance.test.mjs (the official openai client) always runs; chat_page.test.mjs (headless Chromium)
# runs when Chromium is installed, and is skipped with a message when it is not.
# Installs nothing: scripts/setup brings node_modules (npm ci) and Chromium (apt).
# TQ_SCREENSHOT=docs/serve-chat.png makes the page test write its screenshot there.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 PATH/TO/turboquant-serve" >&2
  exit 2
fi
bin="$(realpath "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
if [ ! -x "$bin" ]; then
  echo "serve tests: $1 is not an executable" >&2
  exit 2
fi
if ! command -v node >/dev/null 2>&1; then
  echo "serve tests: node is missing (Node.js 20 comes with the machine)" >&2
  exit 1
fi
if [ ! -d "$here/node_modules/openai" ] || [ ! -d "$here/node_modules/playwright-core" ]; then
  echo "serve tests: $here/node_modules is missing or incomplete: run scripts/setup (it runs npm ci there)" >&2
  exit 1
fi

tests=("$here/conformance.test.mjs")
chromium="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$chromium" ]; then
  tests+=("$here/chat_page.test.mjs")
  export CHROMIUM="$chromium"
else
  echo "serve tests: SKIP chat_page.test.mjs: no Chromium at $chromium (scripts/setup installs Debian's chromium)"
fi

export TQ_SERVE_BIN="$bin"
# Relative paths are from the repository root (TQ_SCREENSHOT: where the docs are; TQ_CHAT_PAGE: a page
# to serve at / instead of the binary's embedded copy).
root="$(cd "$here/../.." && pwd)"
for var in TQ_SCREENSHOT TQ_CHAT_PAGE; do
  if [ -n "${!var:-}" ] && [[ "${!var}" != /* ]]; then
    export "$var=$root/${!var}"
  fi
done
# Each file starts its own server; running the files one after the other keeps the two cores for one
# server at a time. The hard limit ends everything, servers included, if something hangs.
cd "$here"
exec timeout --kill-after=10 "${TQ_SERVE_TEST_TIMEOUT:-540}" node --test --test-concurrency=1 "${tests[@]}"
