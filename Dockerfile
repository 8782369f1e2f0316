# A worker, exporter or CLI image: `docker compose up` runs Redis, the exporter, two sim workers,
# Prometheus and Grafana (docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY conductor ./conductor
COPY workers ./workers
COPY lua ./lua
COPY migrations ./migrations
RUN pip install --no-cache-dir .
ENTRYPOINT ["conductor"]
