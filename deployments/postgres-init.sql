-- One Postgres for the stack: Prefect's database, MLflow's backend store, the DuckLake catalog.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
CREATE DATABASE ducklake;
CREATE DATABASE mlflow_auth;
