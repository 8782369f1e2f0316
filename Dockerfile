# A worker or CLI image: `docker compose up` runs Redis, two sim workers and a metrics port each.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY conductor ./conductor
COPY workers ./workers
COPY lua ./lua
COPY migrations ./migrations
RUN pip install --no-cache-dir .
ENTRYPOINT ["conductor"]
