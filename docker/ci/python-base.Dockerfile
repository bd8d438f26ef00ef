# CI only (docker/ci.sh): the Python base the project image builds on where no image registry is
# reachable. Debian's python3 in a venv with torch's CPU wheel preinstalled, so docker/Dockerfile's
# `pip install torch==…` is already satisfied and its torch index is never contacted.
# Build context: a temporary directory ci.sh fills from the host (never the repository):
#   torch-*.whl      the CPU wheel the host's pip finds on its local disk
#   extra-ca/*.crt   the host's extra CA certificates (/usr/local/share/ca-certificates), so pip
#                    inside the build trusts what the host trusts on its way to PyPI
#   pip.conf         the host's index settings that make sense inside (may be empty)
ARG DEBIAN_IMAGE=streamflow-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
    rm -rf /var/lib/apt/lists/*

COPY extra-ca/ /usr/local/share/ca-certificates/
COPY pip.conf /etc/pip.conf
RUN set -eux; update-ca-certificates; python3 -m venv /opt/venv; python --version

COPY torch-*.whl /tmp/wheels/
RUN set -eux; \
    pip install /tmp/wheels/torch-*.whl; \
    rm -rf /tmp/wheels; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
