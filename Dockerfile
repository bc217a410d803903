# Fleet's own image: `fleet operator`, the router (`fleet router-pod`) and the engine SIMULATOR
# (engine.kind: sim, `python -m fleet.sim`) run from it; the Helm chart (charts/fleet) uses it for
# all three. Real engines run from their own images (spec.engine.image, e.g. vllm/vllm-openai).
#
#   docker build -t ghcr.io/inference-fleet/fleet:0.1.0 .
#
# Not built in CI: Docker does not run on the project's test machines (docs/kubernetes.md).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleet ./fleet
COPY router ./router
COPY warmup ./warmup
COPY autoscaler ./autoscaler
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin fleet
# The chart runs every container as this user, with a read-only root file system.
USER 10001
EXPOSE 8080 9090 8081 8000
ENTRYPOINT ["fleet"]
CMD ["--help"]
