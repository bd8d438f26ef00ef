# CI only (docker/ci.sh): Prometheus from Debian's package (2.42.0, the version docker/compose.yaml
# names and tests/streamflow/test_prometheus.py tests), standing in for prom/prometheus where no
# image registry is reachable. Same entry point, user and data directory as the official image;
# wget for compose.yaml's health check.
ARG DEBIAN_IMAGE=streamflow-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}

RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /prometheus; chown nobody:nogroup /prometheus; \
    prometheus --version

USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
