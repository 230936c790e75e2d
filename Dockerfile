# rankmeter: `docker build -t rankmeter .` then `docker run rankmeter serve` (see docker-compose.yml).
# The C modules (service/rankmeter/_treader.c, _events.c) are compiled in a build stage and
# carried by the wheel; the image itself has no compiler.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts/build_native.py scripts/
COPY service/ service/
RUN python scripts/build_native.py --check && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels && useradd --system --uid 10001 rankmeter
USER rankmeter
EXPOSE 9108
HEALTHCHECK --interval=15s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9108/healthz', timeout=2)"
ENTRYPOINT ["rankmeter"]
CMD ["serve", "--create-topics", "4"]
