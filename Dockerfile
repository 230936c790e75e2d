# rankmeter: `docker build -t rankmeter .` then `docker run rankmeter serve` (see docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service/ service/
RUN pip install --no-cache-dir . && useradd --system --uid 10001 rankmeter
USER rankmeter
EXPOSE 9108
HEALTHCHECK --interval=15s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9108/healthz', timeout=2)"
ENTRYPOINT ["rankmeter"]
CMD ["serve", "--create-topics", "4"]
