# Image for docker-compose.yml: the test project with durable installed from this checkout.
FROM python:3.12-slim
WORKDIR /app
COPY . .
RUN pip install --no-cache-dir -e .
ENV PYTHONUNBUFFERED=1
