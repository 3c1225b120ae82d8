# The Airflow image for retrainer: this project installed exactly as the README installs it
# (`bash scripts/setup.sh`, which creates .venv and installs `-e ".[test]"` at the versions locked in
# constraints.txt), so the image runs the same versions of every dependency as CI. Used by docker-compose.yml for
# every Airflow component (api-server, scheduler, dag-processor, triggerer) and the init job.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A compiler for DeepSpeed's JIT ops; tini reaps the task processes' children.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential tini \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 50000 --gid 0 airflow
WORKDIR /opt/retrainer
COPY --chown=airflow:0 . /opt/retrainer
USER airflow

# The README's install step, verbatim (tests/airflow/test_compose.py checks they stay the same).
RUN bash scripts/setup.sh

# The code revision recorded in each published version (the build context has no .git).
ARG CODE_REVISION=unknown
ENV PATH=/opt/retrainer/.venv/bin:$PATH \
    RETRAINER_CODE_REVISION=$CODE_REVISION \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/retrainer/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/retrainer/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    RETRAINER_CONFIG_DIR=/opt/retrainer/configs \
    RETRAINER_HOME=/opt/retrainer-data \
    OMP_NUM_THREADS=1
USER root
RUN mkdir -p /opt/airflow /opt/retrainer-data && chown airflow:0 /opt/airflow /opt/retrainer-data
USER airflow

ENTRYPOINT ["/usr/bin/tini", "--", "airflow"]
CMD ["version"]
