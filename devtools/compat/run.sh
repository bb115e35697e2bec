#!/usr/bin/env bash
# `make compat-test`: Triton's perf_analyzer and KServe's own clients, unchanged, against a real robez.
#
# Everything it needs goes into a private folder ($COMPAT_DIR, default /var/tmp/robez-compat), nothing
# system-wide and nothing in .venv:
#   - kserve 0.21 with the part of its dependencies its clients import (pip --target);
#   - perf-analyzer 2.60.0, whose wheel needs glibc >= 2.38 (this Debian 12 has 2.36): the wheel is
#     unpacked, and Debian 13's libc6, libstdc++6 and libgcc-s1 .debs (fetched with a private apt
#     configuration pointed at trixie) are unpacked beside it; perf_analyzer runs through their ld.so.
# Then it starts `robez serve --grpc-port`, runs perf_analyzer over HTTP and gRPC with no --input-data
# (concurrency 1 to 4, ids of 1 and 256), checks each run printed a server-side section, and runs
# devtools/compat/kserve_clients.py (REST v2 and gRPC, default settings). Exit 1 on any failure.
# `devtools/compat/run.sh record` instead records what the tools send (tests/service/data/compat/).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="$ROOT/.venv/bin/python"
DIR="${COMPAT_DIR:-/var/tmp/robez-compat}"
mkdir -p "$DIR"

# --- kserve's clients -------------------------------------------------------------------------------
if [ ! -d "$DIR/kserve/kserve" ]; then
    "$PY" -m pip install -q --target "$DIR/kserve" --no-deps "kserve==0.21.*" "cloudevents>=1.6.2,<2" \
        timing-asgi tabulate grpc-interceptor "psutil<6" "python-dateutil<3" six deprecation "pandas<3" \
        pytz tzdata
    "$PY" -m pip install -q --target "$DIR/kserve" "kubernetes>=23.3"  # kserve/__init__ imports it
fi

# --- perf_analyzer and a glibc it can run on --------------------------------------------------------
PA_BIN="$DIR/pa/perf_analyzer/bin/perf_analyzer"
if [ ! -x "$PA_BIN" ]; then
    rm -rf "$DIR/pa" "$DIR/wheel" && mkdir -p "$DIR/pa" "$DIR/wheel"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
        -d "$DIR/wheel" "perf-analyzer==2.60.0"
    "$PY" -m zipfile -e "$DIR"/wheel/perf_analyzer-2.60.0-*.whl "$DIR/pa"
    chmod +x "$PA_BIN"
fi
LIBC="$DIR/trixie/root/usr/lib/x86_64-linux-gnu"
if [ ! -e "$LIBC/ld-linux-x86-64.so.2" ]; then
    APT="$DIR/trixie/apt"
    mkdir -p "$APT/parts" "$APT/lists/partial" "$APT/cache/archives/partial" "$DIR/trixie/debs"
    cat > "$APT/parts/trixie.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    OPTS=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$APT/parts"
          -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o Dir::State::status=/dev/null)
    apt-get "${OPTS[@]}" update -qq
    (cd "$DIR/trixie/debs" && apt-get "${OPTS[@]}" download libc6 libstdc++6 libgcc-s1)
    for deb in "$DIR"/trixie/debs/*.deb; do dpkg-deb -x "$deb" "$DIR/trixie/root"; done
fi
perf_analyzer() {
    "$LIBC/ld-linux-x86-64.so.2" --library-path "$LIBC:/usr/lib/x86_64-linux-gnu" "$PA_BIN" "$@"
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if [ "${1:-}" = "record" ]; then  # what the tools send, into tests/service/data/compat/ (reviewed by hand)
    OUT="$DIR/recorded" && rm -rf "$OUT" && mkdir -p "$OUT"
    HTTP_PORT=$(free_port) GRPC_PORT=$(free_port)
    (cd "$ROOT" && timeout 40 "$PY" -m devtools.compat.record --out "$OUT" --http-port "$HTTP_PORT" \
        --grpc-port "$GRPC_PORT" --seconds 30) &
    sleep 3
    (cd "$ROOT" && PYTHONPATH="$DIR/kserve" "$PY" -m devtools.compat.kserve_clients --record \
        --http "127.0.0.1:$HTTP_PORT" --grpc "127.0.0.1:$GRPC_PORT") || true
    wait
    ls -l "$OUT"
    exit 0
fi

# --- a robez to run them against --------------------------------------------------------------------
WORK="$(mktemp -d /tmp/robez-compat-XXXXXX)"
HTTP_PORT=$(free_port)
GRPC_PORT=$(free_port)
ROBEZ_SHM_DIR="$WORK/shm" "$PY" -m service serve --host 127.0.0.1 --port "$HTTP_PORT" \
    --grpc-port "$GRPC_PORT" --data-dir "$WORK/data" > "$WORK/server.log" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$HTTP_PORT/readyz" > /dev/null && break
    sleep 0.5
done

failures=0
for protocol in http grpc; do
    port=$HTTP_PORT && [ "$protocol" = grpc ] && port=$GRPC_PORT
    for ids in 1 256; do
        for concurrency in 1 2 3 4; do
            # --request-count: a fixed number of requests, no stability windows (a shared machine's load
            # would keep them from settling)
            if out=$(perf_analyzer -m demo -i "$protocol" -u "127.0.0.1:$port" --shape "ids:$ids" \
                    --concurrency-range "$concurrency" --request-count 200 2>&1) \
                    && grep -q "Server:" <<< "$out" && grep -q "Successful request count:" <<< "$out"; then
                echo "perf_analyzer $protocol ids=$ids concurrency=$concurrency: $(grep -m1 Throughput <<< "$out" | xargs)"
            else
                echo "FAIL perf_analyzer $protocol ids=$ids concurrency=$concurrency"; echo "$out" | tail -20
                failures=$((failures + 1))
            fi
        done
    done
done
(cd "$ROOT" && PYTHONPATH="$DIR/kserve" "$PY" -m devtools.compat.kserve_clients \
    --http "127.0.0.1:$HTTP_PORT" --grpc "127.0.0.1:$GRPC_PORT") || failures=$((failures + 1))
if [ "$failures" -gt 0 ]; then
    echo "compat-test: $failures failed"; exit 1
fi
echo "compat-test: perf_analyzer (HTTP, gRPC) and kserve's clients all passed"
