# The MarsRL worker image (docker-compose.yml). CPU torch by default; a GPU image picks the torch
# build of its CUDA version and adds the `vllm` extra.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -e '.[cluster]'
CMD ["prefect", "worker", "start", "--pool", "marsrl-process"]
